// The mixture-of-experts FFN of the MoE targets (qwen3moe, qwen35moe): a router picks each token's top-k experts,
// whose SwiGLU outputs are summed weighted by the router's probabilities; qwen35moe adds a shared expert (one dense
// SwiGLU every token takes) scaled by a sigmoid gate. Built op for op as llama.cpp's build_moe_ffn builds it for
// these architectures, so that the backends' fused routing kernels (CUDA's top-k MoE fusion of softmax, argsort,
// get_rows and the renormalisation; its weighted reduction of the k slots) recognise the graph.
// Legend: n = tokens, E = n_embd, X = experts, k = experts used per token, F = one expert's hidden width,
//         Fs = the shared expert's hidden width.
#pragma once

#include "core/gguf_file.h"
#include "core/weights.h"
#include "models/model.h"

#include <string>
#include <vector>

namespace pdf {

struct moe_hparams {
    int64_t              n_expert = 0;        // X
    std::vector<int64_t> n_expert_used;       // k per layer, 1..X
    std::vector<int64_t> n_ff_exp;            // F per layer
    int64_t              n_ff_shexp  = 0;     // Fs; 0: no shared expert
    bool                 renormalise = true;  // the top-k probabilities divided by their sum (HF's norm_topk_prob)
};

// the most experts a layer may have (llama.cpp's LLAMA_MAX_EXPERTS)
constexpr uint32_t MAX_EXPERTS = 1024;

// `{prefix}expert_count`; `expert_used_count` (1..expert_count) and `expert_feed_forward_length` (absent:
// feed_forward_length / expert_used_count, as llama.cpp), each one value or one per layer (n_layer_all entries);
// with shared_expert, `expert_shared_feed_forward_length` (absent: feed_forward_length, as llama.cpp). Each is
// range-checked: a typed error names the key and the expected and actual values.
moe_hparams load_moe_hparams(const gguf_file & f, const std::string & prefix, int n_layer_all, bool shared_expert);

struct moe_layer {
    int64_t       n_expert_used;   // k
    ggml_tensor * gate_inp;        // the router [E, X]
    ggml_tensor * gate_exps;       // [E, F, X], or nullptr when merged:
    ggml_tensor * up_exps;         // [E, F, X], or nullptr when merged:
    ggml_tensor * gate_up_exps;    // [E, 2F, X]: gate then up, one matmul (llama.cpp's --fuse-gate-up-exps)
    ggml_tensor * down_exps;       // [F, E, X]
    ggml_tensor * gate_inp_shexp;  // [E]: the shared expert's gate, or nullptr without one
    ggml_tensor * gate_shexp;      // [E, Fs]
    ggml_tensor * up_shexp;        // [E, Fs]
    ggml_tensor * down_shexp;      // [Fs, E]
};

// blk.il's router, experts (merged gate/up when the file has them) and shared expert (when hp has one), each shape
// checked against hp (a typed error names the tensor and the expected and actual shapes)
moe_layer declare_moe_layer(weights & w, const moe_hparams & hp, int64_t n_embd, int il);

// upper bound on the graph nodes one MoE FFN adds over a dense SwiGLU FFN
size_t moe_graph_nodes(const moe_hparams & hp);

// cur: the normed FFN input [E, n] -> the weighted sum of its k experts' outputs, plus the gated shared expert's
// [E, n]
ggml_tensor * build_moe_ffn(ggml_context * ctx, ggml_cgraph * gf, const moe_layer & l, const moe_hparams & hp,
                            ggml_tensor * cur, int il);

}  // namespace pdf
