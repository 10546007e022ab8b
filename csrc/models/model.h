// What every target architecture provides: its shape (model_info) and one graph builder for batched
// evaluation. Prefill, AR decode, chain verify and tree verify are all this one graph with different
// tokens, positions and mask. A model is read-only once loaded and may be shared by several sessions.
#pragma once

#include "core/backend.h"
#include "core/gguf_file.h"
#include "core/weights.h"

#include <memory>
#include <string>
#include <vector>

namespace pdf {

class kv_cache;
class recurrent_state;

struct model_params {
    int n_gpu_layers = 0;   // layers (counted from the output end) placed on the GPU; -1 = all
    int n_threads    = 0;   // 0 = hardware concurrency
};

// one attention layer's K/V row widths (recurrent layers have none)
struct kv_layer_desc {
    int     il;
    int64_t n_embd_k_gqa;
    int64_t n_embd_v_gqa;
    int64_t head_dim_k;
    int64_t head_dim_v;
};

// one gated-delta-net layer's state sizes
struct recurrent_layer_desc {
    int     il;
    int64_t ssm_size;       // S_v * S_v * H_v floats
    int64_t conv_channels;  // 2 * key_dim + value_dim
    int64_t d_conv;         // conv kernel width
};

struct model_info {
    std::string                arch;
    std::string                path;
    int64_t                    n_vocab     = 0;
    int64_t                    n_embd      = 0;
    int                        n_layer     = 0;
    uint32_t                   n_ctx_train = 0;
    int                        n_pos_per_token = 1;  // 4 for M-RoPE (text: [p, p, p, 0] per token)
    std::vector<kv_layer_desc> kv_layers;
    std::vector<recurrent_layer_desc> recurrent_layers;
};

// inputs of one evaluation graph, all set by the session before each compute
//   tokens, positions: I32 [n_tokens]; kv_slots: I64 [n_tokens] (cache rows written);
//   kq_mask: F16 [n_kv, n_tokens] (0 = visible, -inf = hidden), over cache rows 0..n_kv-1;
//   positions holds n_pos_per_token * n_tokens entries (section-major for M-RoPE);
//   ssm_row: I32 [1], conv_rows: I32 [d_conv-1]: the recurrent state rows to start from (hybrid models);
//   ssm_snapshot_rows: I64 [K]: the rows the K state snapshots go to (never ssm_row)
struct eval_inputs {
    ggml_tensor *    tokens    = nullptr;
    ggml_tensor *    positions = nullptr;
    ggml_tensor *    kv_slots  = nullptr;
    ggml_tensor *    kq_mask   = nullptr;
    ggml_tensor *    ssm_row   = nullptr;
    ggml_tensor *    conv_rows = nullptr;
    ggml_tensor *    ssm_snapshot_rows = nullptr;
    int              n_tokens  = 0;
    int              n_kv      = 0;
    bool             all_logits = false;  // logits for every token, else for the last one only
    std::vector<int> capture_layers;       // layer-input indices to return (0..n_layer)
};

struct eval_outputs {
    ggml_tensor *              logits = nullptr;  // F32 [n_vocab, n_outputs]
    ggml_tensor *              argmax = nullptr;  // I32 [n_outputs]
    std::vector<ggml_tensor *> captured;          // F32 [n_embd, n_tokens], one per capture layer
};

class target_model {
  public:
    virtual ~target_model() = default;

    const model_info & info() const { return info_; }
    backends &         devices() const { return *backends_; }
    size_t             weight_bytes() const { return weights_->n_bytes(); }
    // shared with a DFlash draft, which has neither of its own
    ggml_tensor *      token_embedding() const { return tok_embd_; }
    ggml_tensor *      output_head() const { return output_; }
    // the head (and so the logits) on the CPU backend
    bool               head_on_host() const { return !backends_->on_gpu(info_.n_layer); }

    // rs is null for models without recurrent layers
    virtual eval_outputs build_eval(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const kv_cache & kv, const recurrent_state * rs) const = 0;
    // upper bound on graph nodes for one evaluation
    virtual size_t max_graph_nodes() const { return 64 + 64 * (size_t) info_.n_layer; }

  protected:
    // token_embd (+ output, or a tied copy of token_embd in the head's buffer type), after backends_/weights_ exist
    void load_embedding_and_head(int64_t n_embd, int64_t n_vocab);

    model_info                 info_;
    std::unique_ptr<backends>  backends_;
    std::unique_ptr<gguf_file> file_;
    std::unique_ptr<weights>   weights_;
    ggml_tensor *              tok_embd_ = nullptr;  // [n_embd, n_vocab]
    ggml_tensor *              output_   = nullptr;  // [n_embd, n_vocab] (may be tok_embd_ when tied)
};

// opens `path`, dispatches on general.architecture (models/registry.cpp), loads the weights
std::unique_ptr<target_model> load_target_model(const std::string & path, const model_params & params);

}  // namespace pdf
