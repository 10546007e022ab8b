// Plain descriptors at the bottom of the include graph: what the per-session memory (state/) needs to know
// of a model to size itself, and how the graph builders (models/) see that memory. Both layers depend on
// this header and not on each other's classes.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <string>
#include <vector>

namespace pdf {

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
    int64_t head_dim;       // S (keys and values)
    int64_t n_k_heads;      // Hk
    int64_t n_v_heads;      // Hv
    // floats of one token's q, k (normalised) and v as the state keeps them for a later commit (a row of
    // step_qkv; g and beta, Hv floats each, have rows of their own)
    int64_t step_width() const { return head_dim * (2 * n_k_heads + n_v_heads); }
};

struct model_info {
    std::string                       arch;
    std::string                       path;
    int64_t                           n_vocab         = 0;
    int64_t                           n_embd          = 0;
    int                               n_layer         = 0;
    uint32_t                          n_ctx_train     = 0;
    int                               n_pos_per_token = 1;  // 4 for M-RoPE (text: [p, p, p, 0] per token)
    std::vector<kv_layer_desc>        kv_layers;
    std::vector<recurrent_layer_desc> recurrent_layers;
};

// A session's memory as a graph builder reads and writes it, by layer index (nullptr where a layer has none):
//   k, v:      [row width, n_slots] KV cache rows (slot r holds one token's K / V)
//   ssm, conv: [ssm_size, rows] / [conv_channels, rows] recurrent state rows (see state/recurrent_state.h)
//   step_qkv, step_g, step_beta: [2*S*Hk + S*Hv, rows], [Hv, rows], [Hv, rows]: an evaluation's per-token
//              gated-delta-net inputs, from which a commit recomputes the state of the tokens it keeps
struct state_tensors {
    std::vector<ggml_tensor *> k, v, ssm, conv, step_qkv, step_g, step_beta;
};

// The graph inputs that say where a batch goes in that memory, each set by the part of state/ that owns it.
// The KV cache's (state/kv_cache.h): the cache rows written and what each token sees.
//   slots: I64 [n_tokens]; kq_mask: F16 [n_kv, n_tokens] (0 = visible, -inf = hidden), over rows 0..n_kv-1
struct kv_inputs {
    ggml_tensor * slots   = nullptr;
    ggml_tensor * kq_mask = nullptr;
    int           n_kv    = 0;
};

// The recurrent state's (state/recurrent_state.h). The state of every token is not kept: an evaluation writes
// one state (ssm_out_row) and, unless it is committed whole, its tokens' gated-delta-net inputs (step rows 0..),
// from which a commit of some of them recomputes their state (state/recurrent_state.h).
// Chain evaluation (tree_levels empty: token i follows token i-1):
//   ssm_row: I32 [1]: the state row to start from; ssm_out_row: I64 [1]: where the state after token
//   ssm_split_at (0: after the last token) goes, never ssm_row; keep_steps: write the inputs of tokens
//   ssm_split_at .. n-1 to step rows 0 ..; conv_rows: I32 [d_conv-1]: the conv window rows (oldest first);
//   conv_keep_from: the first row of [window ‖ inputs] written back to the conv buffer.
// Tree evaluation (tree_levels = node counts per depth; rows are in level order: the nodes of depth d are rows
// [sum of earlier levels, + tree_levels[d]), and a node's parent is in the level before):
//   tree_root_state: I32 [tree_levels[0]]: the state row each depth-0 node starts from (all ssm_row);
//   tree_parent: I32 [n - tree_levels[0]]: for the nodes of depth >= 1, the parent's index in its level;
//   tree_out_rows: I64 [n]: 0 .. n-1; node j's inputs go to step row j, and no state is written;
//   conv_taps: I32 [d_conv * n]: per node, the rows of [window ‖ inputs] under its conv kernel, oldest
//   first (its d_conv-1 nearest ancestors, reaching into the window above depth 0, then itself);
//   [window ‖ inputs] is written back to conv buffer rows 0 .. d_conv-2+n.
struct recurrent_inputs {
    ggml_tensor *    conv_rows       = nullptr;
    ggml_tensor *    ssm_row         = nullptr;
    ggml_tensor *    ssm_out_row     = nullptr;
    int              ssm_split_at    = 0;
    bool             keep_steps      = false;
    int              conv_keep_from  = 0;
    std::vector<int> tree_levels;
    ggml_tensor *    tree_root_state = nullptr;
    ggml_tensor *    tree_parent     = nullptr;
    ggml_tensor *    tree_out_rows   = nullptr;
    ggml_tensor *    conv_taps       = nullptr;
};

}  // namespace pdf
