// Everything mutable about one conversation with a target model: the KV cache, the committed length,
// the scheduler and the current evaluation graph. The model is shared and read-only.
//
// Basic usage:
//   pdf::session s(model, params);
//   s.eval(tokens, positions, n, /*batch_mask*/ nullptr, ...);  // writes cache slots n_past .. n_past+n-1
//   s.commit(n_accepted);                                       // keeps the first n_accepted of them
//
// A session is not thread-safe; use one per thread (several may share one model).
#pragma once

#include "models/model.h"
#include "state/feature_ring.h"
#include "state/kv_cache.h"
#include "state/recurrent_state.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace pdf {

struct session_params {
    uint32_t  n_ctx    = 4096;
    uint32_t  n_ubatch = 512;  // prefill micro-batch
    uint32_t  n_rollback = 16;  // hybrid models: an eval of up to this many tokens can be committed at any token
    ggml_type type_k   = GGML_TYPE_F16;
    ggml_type type_v   = GGML_TYPE_F16;
};

enum logits_mode {
    LOGITS_NONE,  // only the argmax of the last token is read back
    ARGMAX_ALL,   // only the argmax of every token (verification)
    LOGITS_LAST,  // logits of the last token
    LOGITS_ALL,   // logits of every token
};

class session {
  public:
    session(std::shared_ptr<const target_model> model, const session_params & params);
    ~session();
    session(const session &)             = delete;
    session & operator=(const session &) = delete;

    // Evaluate n tokens at the given positions (RoPE) into cache slots n_past .. n_past+n-1. Token i sees
    // every committed slot and batch token j iff batch_mask[i*n + j] != 0 (nullptr: causal, j <= i).
    // capture_layers: layer-input indices whose hidden states are kept: read back to the host ([n, n_embd]
    // each, captured()) or, with a ring, written by the graph itself into ring rows slot % capacity (the
    // layers side by side in each row), never leaving the device.
    void eval(const int32_t * tokens, const int32_t * positions, int n, const uint8_t * batch_mask,
              logits_mode mode, const std::vector<int> & capture_layers = {}, feature_ring * ring = nullptr);
    // keep the first n tokens of the last eval as committed (chain acceptance); recurrent state included
    void commit(int n);
    // forget committed tokens from position n_past on (recurrent models: only back to 0, i.e. a reset)
    void truncate(int n_past);
    bool is_recurrent() const { return rs_ != nullptr; }
    size_t recurrent_bytes() const { return rs_ ? rs_->n_bytes() : 0; }

    int      n_past() const { return n_past_; }
    uint32_t n_ctx() const { return kv_->n_ctx(); }
    uint32_t n_ubatch() const { return n_ubatch_; }
    size_t   kv_bytes() const { return kv_->n_bytes(); }

    // results of the last eval
    int                         n_outputs() const { return n_outputs_; }
    const std::vector<float> &  logits() const { return logits_; }  // [n_outputs, n_vocab] row-major
    const std::vector<int32_t> & argmax() const { return argmax_; }
    const std::vector<float> &  captured(size_t c) const { return captured_[c]; }  // [n, n_embd]

    const target_model &          model() const { return *model_; }
    const std::vector<int32_t> &  tokens() const { return tokens_; }  // committed token ids

    std::atomic<bool> abort{false};  // checked between graph computes

  private:
    struct graph_key {
        int              n_tokens;
        int              n_kv;
        bool             all_logits;
        std::vector<int> capture;
        feature_ring *   ring = nullptr;
        bool operator==(const graph_key & o) const {
            return n_tokens == o.n_tokens && n_kv == o.n_kv && all_logits == o.all_logits && capture == o.capture &&
                   ring == o.ring;
        }
    };
    void prepare_graph(const graph_key & key);

    std::shared_ptr<const target_model> model_;
    std::unique_ptr<kv_cache>           kv_;
    std::unique_ptr<recurrent_state>    rs_;
    ggml_backend_sched_t                sched_ = nullptr;
    int                                 n_past_ = 0;
    uint32_t                            n_ubatch_;

    // the current graph; rebuilt only when its key changes (batch size, KV window, outputs)
    bool                  have_graph_ = false;
    graph_key             key_{};
    ggml_context *        graph_ctx_ = nullptr;
    ggml_cgraph *         gf_        = nullptr;
    eval_inputs           in_;
    eval_outputs          out_;
    ggml_tensor *         ring_slots_ = nullptr;  // I64 [n_tokens]: feature-ring rows written (with a ring)
    std::vector<uint8_t>  graph_buf_;

    std::vector<int32_t>              tokens_;   // committed token ids
    std::vector<int32_t>              pending_;  // token ids of the last eval, until commit
    int                               n_outputs_ = 0;
    std::vector<float>                logits_;
    std::vector<int32_t>              argmax_;
    std::vector<std::vector<float>>   captured_;
    std::vector<ggml_fp16_t>          mask_host_;
    std::vector<int64_t>              slots_host_;
};

}  // namespace pdf
