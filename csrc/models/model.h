// What every target architecture provides: its shape (model_info) and one graph builder for batched
// evaluation. Prefill, AR decode, chain verify and tree verify are all this one graph with different
// tokens, positions and mask. A model is read-only once loaded and may be shared by several sessions.
// The builder ends at the final normed hidden states: what is read from them (greedy pick, top-k
// log-probabilities, logits) is the caller's choice (models/head.h).
#pragma once

#include "core/backend.h"
#include "core/gguf_file.h"
#include "core/model_desc.h"
#include "core/weights.h"

#include <memory>
#include <string>
#include <vector>

namespace pdf {

// how a hybrid target's prefill micro-batches (chains committed whole) run the delta rule: ggml's fused op
// (token by token, on the backends that have it), or the chunked form in stock ops (models/delta_net.h);
// automatic: fused where the backend holding the layer supports ggml_gated_delta_net, else chunked, as
// llama.cpp decides (a probe of the op)
enum class delta_net_form { automatic, fused, chunked };

struct model_params {
    int n_gpu_layers = 0;   // layers (counted from the output end) placed on the GPU; -1 = all
    int n_cpu_moe    = 0;   // the experts of the first n layers stay in system memory (llama.cpp's --n-cpu-moe); -1 = all
    int n_threads    = 0;   // 0 = hardware concurrency
    std::vector<float> tensor_split;  // the offloaded layers' split over GPU devices (core/backend.h)
    load_progress progress;  // called as the weights are read (may be empty)
    bool plan_only = false;  // a memory plan: metadata only, planned buffers (core/planned_buffer.h)
    delta_net_form delta_net = delta_net_form::automatic;
};

// One session's rows in an evaluation over several sessions (state/session_batch.h): rows [first, first +
// n_tokens) of the batch, with that session's memory (st) and where its rows go in it (kv, recurrent)
struct sequence_inputs {
    int              first    = 0;
    int              n_tokens = 0;
    kv_inputs        kv;
    recurrent_inputs recurrent;
    state_tensors    st;
};

// Inputs of one evaluation graph, all set by the session before each compute.
//   tokens, positions: I32 [n_tokens]; positions holds n_pos_per_token * n_tokens entries (section-major for
//   M-RoPE); kv, recurrent: where the batch goes in the session's memory (core/model_desc.h)
//   sequences: a batch over several sessions (their rows one after another): each one's attention, recurrent
//   state and conv run on its own rows and memory (models/sequences.h), everything else over all the rows;
//   kv, recurrent and the state passed with the inputs are then unused. output_rows: I32 [n_outputs], the rows
//   whose hidden states come out (every row's are computed).
struct eval_inputs {
    ggml_tensor *    tokens      = nullptr;
    ggml_tensor *    positions   = nullptr;
    kv_inputs        kv;
    recurrent_inputs recurrent;
    int              n_tokens    = 0;
    bool             all_outputs = false;  // hidden states of every token, else of the last one only
    std::vector<int> capture_layers;        // layer-input indices to return (0..n_layer)
    std::vector<sequence_inputs> sequences;  // several sessions' rows (empty: one session's)
    ggml_tensor *                output_rows = nullptr;  // with sequences
};

struct eval_outputs {
    ggml_tensor *              hidden = nullptr;  // F32 [n_embd, n_outputs], after the final norm
    std::vector<ggml_tensor *> captured;          // F32 [n_embd, n_tokens], one per capture layer
};

// A model file read in three steps that each model supplies the middle of: its constructor reads the
// hyper-parameters (checked) and describes itself (info_), a backends places its layers, and declare_weights
// names its tensors (checked against those hyper-parameters), which read_weights then reads.
class loaded_model {
  public:
    virtual ~loaded_model();

    const model_info &           info() const { return info_; }
    size_t                       weight_bytes() const { return weights_->n_bytes(); }
    device_bytes                 weight_memory() const { return weights_->memory(); }
    device_bytes                 expert_memory() const { return weights_->expert_memory(); }
    std::vector<weights::placed> weight_placement() const { return weights_->placement(); }

  protected:
    explicit loaded_model(std::unique_ptr<gguf_file> file);
    // every weight, declared (weights::require / optional) in the order the buffers hold them
    virtual void declare_weights(weights & w) = 0;
    // declares the weights placed by `devices` (kept while they are), then reads them
    void         read_weights(std::shared_ptr<backends> devices, const load_progress & progress);
    // a plan's weights become a load's once `devices_` have (backends::realize): moved into real buffers, read
    void         realize_weights(const load_progress & progress);

    std::unique_ptr<gguf_file> file_;
    model_info                 info_;
    std::shared_ptr<backends>  devices_;  // where the layers are (a drafter: its target's)
    std::unique_ptr<weights>   weights_;
};

// A target architecture: its hyper-parameters (constructor), its layers' tensors (declare_layer) and one layer of
// its graph (build_layer). The base holds what they share: the token embedding, the head and the final norm,
// where the layers go, and the layer stack (with the feature capture a drafter reads).
class target_model : public loaded_model {
  public:
    // A memory plan's model (params.plan_only) becomes this load's: the plan decided the layers' places, its
    // tensors are moved into real buffers and read from the file, so a load that planned first builds its model
    // once. params as a load's (n_gpu_layers must place the layers where the plan did); only before any session
    // over the plan computes, and before the drafter's own realize.
    void          realize(const model_params & params);
    backends &    devices() const { return *devices_; }
    // shared with a DFlash draft, which has neither of its own
    ggml_tensor * token_embedding() const { return tok_embd_; }
    ggml_tensor * output_head() const { return output_; }
    // the head (and so the logits) on the CPU backend
    bool          head_on_host() const { return !devices_->on_gpu(info_.n_layer); }
    // The rows an evaluation takes in whole tiles of: what a verify of n rows costs is that of n rounded up to a
    // whole number of tiles, or more. A dense target on the CPU: ggml's quantized matmul kernels (repacked
    // Q4_0, llamafile's Q8_0) take the rows four at a time and the rest one by one, each another pass over the
    // weights (llama-bench, 2 threads of a Zen 5, the 0.3B-cost qwen35 targets at width 768, ms: q4mix 4 rows
    // 15.5, 7 27.3, 8 22.0, 13 35.0, 15 41.1, 16 29.7; q8_0 4 rows 36.2, 5 44.9, 12 49.0, 15 65.4, 16 53.7). A
    // MoE target's experts take each their own rows, and its time grows row by row (qwen35moe q4mix: 2 rows
    // 16.9, 3 22.6, 4 28.2, 5 32.9). On a GPU: 1 (any width).
    int           verify_row_tile() const;

    // tokens -> the layers -> hidden [E, n_outputs] after the final norm (n_outputs = n, or 1 without
    // in.all_outputs), with the inputs of in.capture_layers ([E, n] each; index n_layer: the last layer's output)
    eval_outputs build_eval(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                            const state_tensors & st) const;
    // upper bound on graph nodes for one evaluation of n_tokens (a tree evaluation of n_tree_levels depths)
    virtual size_t max_graph_nodes(int n_tree_levels = 0, int n_tokens = 1) const {
        return 96 + 64 * (size_t) info_.n_layer;
    }

    // The target's own multi-token-prediction head (MTP: Qwen3.5's nextn block, GGUF blk.{n_layer}.nextn.*), when
    // the file ships one: its K/V rows (layer index kv.il; a session of its own keeps them, state/mtp_session.h).
    // has_mtp() false: none (mtp_missing() says why, naming the file and what it lacks).
    virtual bool          has_mtp() const { return false; }
    virtual std::string   mtp_missing() const;
    virtual kv_layer_desc mtp_kv_layer() const { return {}; }
    // One MTP step for n tokens: tokens [n] at in.positions, each with h [E, n], the trunk's final normed hidden
    // state at the position before (or the head's own h' of the step before) -> h' [E, n], normed, which
    // mtp_output_head() turns into the token after; the last row's only ([E, 1]) with last_only. Its attention
    // writes every row's K/V into st.k/v[mtp_kv_layer().il] (through in.kv, expanded into gf: a graph that needs
    // only those leaves the result out) and reads them back.
    virtual ggml_tensor * build_mtp(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const state_tensors & st, ggml_tensor * h, bool last_only) const;
    virtual ggml_tensor * mtp_output_head() const { return output_; }
    virtual size_t        mtp_graph_nodes() const { return 0; }
    // x [E, n] (a last layer's output) -> the final norm's output, as build_eval computes it
    ggml_tensor *         build_output_norm(ggml_context * ctx, ggml_tensor * x) const;

  protected:
    using loaded_model::loaded_model;
    // what every architecture describes alike; the vocabulary is token_embd's rows. norm_eps: the final norm's
    void describe(const std::string & arch, int64_t n_embd, int n_layer, uint32_t n_ctx_train, float norm_eps);
    // the weights of layer il (after the embedding, the head and the final norm)
    virtual void          declare_layer(weights & w, int il) = 0;
    // after the weights are read: choices that depend on where the layers went
    virtual void          loaded(const model_params & params) {}
    // after every layer: weights beyond the layer stack (an MTP head), when the file has them
    virtual void          declare_extra(weights & w) {}
    // layer il: x [E, n] -> [E, n], or [E, 1] with last_token_only (its K/V and state still written for all n)
    virtual ggml_tensor * build_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                      const state_tensors & st, int il, ggml_tensor * x,
                                      bool last_token_only) const = 0;

  private:
    friend std::unique_ptr<target_model> load_target_model(const std::string & path, const model_params & params);
    // places the layers, declares and reads every weight, then loaded()
    void load(const model_params & params);
    void declare_weights(weights & w) final;

    float                     norm_eps_    = 0.0f;
    ggml_tensor *             tok_embd_    = nullptr;  // [n_embd, n_vocab]
    ggml_tensor *             output_      = nullptr;  // [n_embd, n_vocab] (may be tok_embd_ when tied)
    ggml_tensor *             output_norm_ = nullptr;  // [n_embd]
};

// opens `path`, dispatches on general.architecture (models/registry.cpp), loads the weights
std::unique_ptr<target_model> load_target_model(const std::string & path, const model_params & params);

}  // namespace pdf
