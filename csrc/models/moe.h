// The mixture-of-experts FFN of the MoE targets (qwen3moe): a router picks each token's top-k experts, whose SwiGLU
// outputs are summed weighted by the router's probabilities. Built op for op as llama.cpp's build_moe_ffn builds
// it for these architectures, so that the backends' fused routing kernels (CUDA's top-k MoE fusion of softmax,
// argsort, get_rows and the renormalisation) recognise the graph.
// A shared expert (qwen35moe: one dense SwiGLU every token takes, scaled by a sigmoid gate) is a later addition
// beside the routed experts: its tensors would join moe_layer as optional ones, its output the routed sum.
// Legend: n = tokens, E = n_embd, X = experts, k = experts used per token, F = one expert's hidden width.
#pragma once

#include "core/gguf_file.h"
#include "core/weights.h"
#include "models/model.h"

#include <string>

namespace pdf {

struct moe_hparams {
    int64_t n_expert      = 0;     // X
    int64_t n_expert_used = 0;     // k, 1..X
    int64_t n_ff_exp      = 0;     // F
    bool    renormalise   = true;  // the top-k probabilities divided by their sum (HF's norm_topk_prob)
};

// the most experts a layer may have (llama.cpp's LLAMA_MAX_EXPERTS)
constexpr uint32_t MAX_EXPERTS = 1024;

// `{prefix}expert_count`, `expert_used_count` (1..expert_count) and `expert_feed_forward_length` (absent:
// feed_forward_length / expert_used_count, as llama.cpp), each range-checked: a typed error names the key and the
// expected and actual values
moe_hparams load_moe_hparams(const gguf_file & f, const std::string & prefix);

struct moe_layer {
    ggml_tensor * gate_inp;   // the router [E, X]
    ggml_tensor * gate_exps;  // [E, F, X]
    ggml_tensor * up_exps;    // [E, F, X]
    ggml_tensor * down_exps;  // [F, E, X]
};

// blk.il's router and stacked experts, each shape checked against hp (a typed error names the tensor and the
// expected and actual shapes)
moe_layer declare_moe_layer(weights & w, const moe_hparams & hp, int64_t n_embd, int il);

// upper bound on the graph nodes one MoE FFN adds over a dense SwiGLU FFN
size_t moe_graph_nodes(const moe_hparams & hp);

// cur: the normed FFN input [E, n] -> the weighted sum of its k experts' outputs [E, n]
ggml_tensor * build_moe_ffn(ggml_context * ctx, ggml_cgraph * gf, const moe_layer & l, const moe_hparams & hp,
                            ggml_tensor * cur, int il);

}  // namespace pdf
