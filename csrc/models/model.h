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
    int n_threads    = 0;   // 0 = hardware concurrency
    load_progress progress;  // called as the weights are read (may be empty)
    bool plan_only = false;  // a memory plan: metadata only, planned buffers (core/planned_buffer.h)
    delta_net_form delta_net = delta_net_form::automatic;
};

// Inputs of one evaluation graph, all set by the session before each compute.
//   tokens, positions: I32 [n_tokens]; kv_slots: I64 [n_tokens] (cache rows written);
//   kq_mask: F16 [n_kv, n_tokens] (0 = visible, -inf = hidden), over cache rows 0..n_kv-1;
//   positions holds n_pos_per_token * n_tokens entries (section-major for M-RoPE).
// Recurrent layers, chain evaluation (tree_levels empty: token i follows token i-1):
//   ssm_row: I32 [1]: the state row to start from; ssm_snapshot_rows: I64 [K]: the rows the K most recent
//   per-token states go to (most recent first, never ssm_row); conv_rows: I32 [d_conv-1]: the conv window
//   rows (oldest first); conv_keep_from: the first row of [window ‖ inputs] written back to the conv buffer.
// Recurrent layers, tree evaluation (tree_levels = node counts per depth; rows are in level order: the nodes
// of depth d are rows [sum of earlier levels, + tree_levels[d]), and a node's parent is in the level before):
//   tree_root_state: I32 [tree_levels[0]]: the state row each depth-0 node starts from (all ssm_row);
//   tree_parent: I32 [n - tree_levels[0]]: for the nodes of depth >= 1, the parent's index in its level;
//   tree_state_rows: I64 [n]: the state row each node's state goes to; tree_out_rows: I64 [n]: 0 .. n-1;
//   conv_taps: I32 [d_conv * n]: per node, the rows of [window ‖ inputs] under its conv kernel, oldest
//   first (its d_conv-1 nearest ancestors, reaching into the window above depth 0, then itself);
//   [window ‖ inputs] is written back to conv buffer rows 0 .. d_conv-2+n.
struct eval_inputs {
    ggml_tensor *    tokens            = nullptr;
    ggml_tensor *    positions         = nullptr;
    ggml_tensor *    kv_slots          = nullptr;
    ggml_tensor *    kq_mask           = nullptr;
    ggml_tensor *    ssm_row           = nullptr;
    ggml_tensor *    conv_rows         = nullptr;
    ggml_tensor *    ssm_snapshot_rows = nullptr;
    int              conv_keep_from    = 0;
    std::vector<int> tree_levels;
    ggml_tensor *    tree_root_state   = nullptr;
    ggml_tensor *    tree_parent       = nullptr;
    ggml_tensor *    tree_state_rows   = nullptr;
    ggml_tensor *    tree_out_rows     = nullptr;
    ggml_tensor *    conv_taps         = nullptr;
    int              n_tokens          = 0;
    int              n_kv              = 0;
    bool             all_outputs       = false;  // hidden states of every token, else of the last one only
    std::vector<int> capture_layers;              // layer-input indices to return (0..n_layer)
};

struct eval_outputs {
    ggml_tensor *              hidden = nullptr;  // F32 [n_embd, n_outputs], after the final norm
    std::vector<ggml_tensor *> captured;          // F32 [n_embd, n_tokens], one per capture layer
};

class target_model {
  public:
    virtual ~target_model() = default;

    const model_info & info() const { return info_; }
    backends &         devices() const { return *backends_; }
    size_t             weight_bytes() const { return weights_->n_bytes(); }
    device_bytes       weight_memory() const { return weights_->memory(); }
    std::vector<weights::placed> weight_placement() const { return weights_->placement(); }
    // shared with a DFlash draft, which has neither of its own
    ggml_tensor *      token_embedding() const { return tok_embd_; }
    ggml_tensor *      output_head() const { return output_; }
    // the head (and so the logits) on the CPU backend
    bool               head_on_host() const { return !backends_->on_gpu(info_.n_layer); }

    virtual eval_outputs build_eval(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const state_tensors & st) const = 0;
    // upper bound on graph nodes for one evaluation of n_tokens (a tree evaluation of n_tree_levels depths)
    virtual size_t max_graph_nodes(int n_tree_levels = 0, int n_tokens = 1) const {
        return 96 + 64 * (size_t) info_.n_layer;
    }

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
