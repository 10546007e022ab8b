#include "models/moe.h"
#include "core/error.h"

#include <cmath>
#include <vector>

namespace pdf {

moe_hparams load_moe_hparams(const gguf_file & f, const std::string & prefix) {
    moe_hparams hp;
    hp.n_expert      = f.u32_in(prefix + "expert_count", 1, MAX_EXPERTS);
    hp.n_expert_used = f.u32_in(prefix + "expert_used_count", 1, (uint32_t) hp.n_expert);
    // llama.cpp's fallback (a width of 0 fails as the experts' shapes are checked, naming the tensor)
    const std::string ff_exp = prefix + "expert_feed_forward_length";
    const std::string ff     = prefix + "feed_forward_length";
    hp.n_ff_exp = f.has_key(ff_exp) ? f.u32_in(ff_exp, 1, 1 << 24) : f.u32_in(ff, 1, 1 << 24) / hp.n_expert_used;
    return hp;
}

moe_layer declare_moe_layer(weights & w, const moe_hparams & hp, int64_t n_embd, int il) {
    const int64_t E = n_embd, F = hp.n_ff_exp, X = hp.n_expert;
    auto          name = [il](const char * s) { return format("blk.%d.%s", il, s); };
    moe_layer     l;
    l.gate_inp  = w.require(name("ffn_gate_inp.weight"), {E, X}, il, WEIGHT_USE_MATMUL);
    l.gate_exps = w.require(name("ffn_gate_exps.weight"), {E, F, X}, il, WEIGHT_USE_MATMUL_ID);
    l.up_exps   = w.require(name("ffn_up_exps.weight"), {E, F, X}, il, WEIGHT_USE_MATMUL_ID);
    l.down_exps = w.require(name("ffn_down_exps.weight"), {F, E, X}, il, WEIGHT_USE_MATMUL_ID);
    return l;
}

size_t moe_graph_nodes(const moe_hparams & hp) {
    // routing and renormalisation ~12, three mul_mat_id and the activation, then per slot a view and an add
    return 24 + 2 * (size_t) hp.n_expert_used;
}

// cur: [E, n] -> [E, n]. Router: logits [X, n] -> probs [X, n] -> selected I32 [k, n] -> weights [1, k, n];
// experts: up, gate [F, k, n] -> SwiGLU [F, k, n] -> down [E, k, n] -> weighted, summed over the k slots
ggml_tensor * build_moe_ffn(ggml_context * ctx, ggml_cgraph * gf, const moe_layer & l, const moe_hparams & hp,
                            ggml_tensor * cur, int il) {
    const int64_t E = cur->ne[0], n = cur->ne[1], X = hp.n_expert, k = hp.n_expert_used;

    ggml_tensor * logits = ggml_mul_mat(ctx, l.gate_inp, cur);  // [X, n]
    ggml_format_name(logits, "ffn_moe_logits-%d", il);
    ggml_tensor * probs = ggml_soft_max(ctx, logits);            // [X, n]
    ggml_format_name(probs, "ffn_moe_probs-%d", il);
    ggml_tensor * selected = ggml_argsort_top_k(ctx, probs, (int) k);  // [k, n]
    ggml_format_name(selected, "ffn_moe_topk-%d", il);
    // each token's k probabilities, picked as rows of [1, X, n]
    ggml_tensor * weights = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, X, n), selected);  // [1, k, n]
    if (hp.renormalise) {
        weights = ggml_reshape_2d(ctx, weights, k, n);
        // the clamp keeps a sum that underflowed from dividing by zero (llama.cpp's bound: F16's smallest normal)
        ggml_tensor * sum = ggml_clamp(ctx, ggml_sum_rows(ctx, weights), 6.103515625e-5f, INFINITY);  // [1, n]
        weights           = ggml_reshape_3d(ctx, ggml_div(ctx, weights, sum), 1, k, n);
    }
    ggml_format_name(weights, "ffn_moe_weights-%d", il);
    ggml_build_forward_expand(gf, weights);  // the routing as one run of nodes, where the fused kernel finds it

    cur              = ggml_reshape_3d(ctx, cur, E, 1, n);
    ggml_tensor * up = ggml_mul_mat_id(ctx, l.up_exps, cur, selected);    // [F, k, n]
    ggml_tensor * gt = ggml_mul_mat_id(ctx, l.gate_exps, cur, selected);  // [F, k, n]
    ggml_tensor * experts = ggml_mul_mat_id(ctx, l.down_exps, ggml_swiglu_split(ctx, gt, up), selected);  // [E, k, n]
    experts               = ggml_mul(ctx, experts, weights);
    ggml_format_name(experts, "ffn_moe_weighted-%d", il);
    ggml_build_forward_expand(gf, experts);

    // the slots summed in order: views first, then the adds (as llama.cpp orders them)
    std::vector<ggml_tensor *> slots(k);
    for (int64_t i = 0; i < k; ++i) {
        slots[i] = ggml_view_2d(ctx, experts, E, n, experts->nb[2], i * experts->nb[1]);  // [E, n]
        ggml_build_forward_expand(gf, slots[i]);
    }
    ggml_tensor * out = slots[0];
    for (int64_t i = 1; i < k; ++i) {
        out = ggml_add(ctx, out, slots[i]);
        ggml_build_forward_expand(gf, out);
    }
    if (k == 1) {
        out = ggml_cont(ctx, out);  // a view of one slot is not contiguous
    }
    ggml_format_name(out, "ffn_moe_out-%d", il);
    return out;
}

}  // namespace pdf
