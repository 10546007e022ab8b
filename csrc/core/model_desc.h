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
struct state_tensors {
    std::vector<ggml_tensor *> k, v, ssm, conv;
};

}  // namespace pdf
