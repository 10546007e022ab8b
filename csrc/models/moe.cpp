#include "models/moe.h"
#include "core/error.h"
#include "models/blocks.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace pdf {

moe_hparams load_moe_hparams(const gguf_file & f, const std::string & prefix, int n_layer_all, bool shared_expert) {
    moe_hparams hp;
    hp.n_expert = f.u32_in(prefix + "expert_count", 1, MAX_EXPERTS);
    for (uint32_t k : f.u32_per_layer_in(prefix + "expert_used_count", n_layer_all, 1, (uint32_t) hp.n_expert)) {
        hp.n_expert_used.push_back(k);
    }
    // llama.cpp's fallbacks (a width of 0 fails as the experts' shapes are checked, naming the tensor)
    const std::string ff_exp = prefix + "expert_feed_forward_length";
    const std::string ff     = prefix + "feed_forward_length";
    if (f.has_key(ff_exp)) {
        for (uint32_t w : f.u32_per_layer_in(ff_exp, n_layer_all, 1, 1 << 24)) {
            hp.n_ff_exp.push_back(w);
        }
    } else {
        const int64_t n_ff = f.u32_in(ff, 1, 1 << 24);
        for (int64_t k : hp.n_expert_used) {
            hp.n_ff_exp.push_back(n_ff / k);
        }
    }
    if (shared_expert) {
        const std::string ff_shexp = prefix + "expert_shared_feed_forward_length";
        hp.n_ff_shexp = f.has_key(ff_shexp) ? f.u32_in(ff_shexp, 1, 1 << 24) : f.u32_in(ff, 1, 1 << 24);
    }
    return hp;
}

moe_layer declare_moe_layer(weights & w, const moe_hparams & hp, int64_t n_embd, int il) {
    const int64_t E = n_embd, F = hp.n_ff_exp[il], X = hp.n_expert, Fs = hp.n_ff_shexp;
    auto          name = [il](const char * s) { return format("blk.%d.%s", il, s); };
    moe_layer     l{};
    l.n_expert_used = hp.n_expert_used[il];
    l.gate_inp      = w.require(name("ffn_gate_inp.weight"), {E, X}, il, WEIGHT_USE_MATMUL);
    l.gate_up_exps  = w.optional(name("ffn_gate_up_exps.weight"), {E, 2 * F, X}, il, WEIGHT_USE_MATMUL_ID);
    if (!l.gate_up_exps) {
        l.gate_exps = w.require(name("ffn_gate_exps.weight"), {E, F, X}, il, WEIGHT_USE_MATMUL_ID);
        l.up_exps   = w.require(name("ffn_up_exps.weight"), {E, F, X}, il, WEIGHT_USE_MATMUL_ID);
    }
    l.down_exps = w.require(name("ffn_down_exps.weight"), {F, E, X}, il, WEIGHT_USE_MATMUL_ID);
    if (Fs > 0) {
        l.gate_inp_shexp = w.require(name("ffn_gate_inp_shexp.weight"), {E}, il, WEIGHT_USE_MATMUL);
        l.gate_shexp     = w.require(name("ffn_gate_shexp.weight"), {E, Fs}, il, WEIGHT_USE_MATMUL);
        l.up_shexp       = w.require(name("ffn_up_shexp.weight"), {E, Fs}, il, WEIGHT_USE_MATMUL);
        l.down_shexp     = w.require(name("ffn_down_shexp.weight"), {Fs, E}, il, WEIGHT_USE_MATMUL);
    }
    return l;
}

size_t moe_graph_nodes(const moe_hparams & hp) {
    // routing and renormalisation ~12, three mul_mat_id and the activation, then per slot a view and an add; the
    // shared expert and its gate ~10
    const int64_t k_max = *std::max_element(hp.n_expert_used.begin(), hp.n_expert_used.end());
    return 34 + 2 * (size_t) k_max;
}

namespace {

struct routing {
    ggml_tensor * selected;  // I32 [k, n]: each token's experts, most probable first
    ggml_tensor * weights;   // [1, k, n]: their probabilities (renormalised to sum 1 where hp says so)
};

// cur: [E, n] -> logits [X, n] -> probs [X, n] -> the top k and their probabilities
routing build_routing(ggml_context * ctx, ggml_cgraph * gf, const moe_layer & l, const moe_hparams & hp,
                      ggml_tensor * cur, int il) {
    const int64_t n = cur->ne[1], X = hp.n_expert, k = l.n_expert_used;
    ggml_tensor * logits = ggml_mul_mat(ctx, l.gate_inp, cur);  // [X, n]
    ggml_format_name(logits, "ffn_moe_logits-%d", il);
    ggml_tensor * probs = ggml_soft_max(ctx, logits);  // [X, n]
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
    return {selected, weights};
}

// cur: [E, n] -> each token's k experts' SwiGLU outputs [E, k, n], weighted
ggml_tensor * build_routed_experts(ggml_context * ctx, const moe_layer & l, const routing & r, ggml_tensor * cur) {
    const int64_t E = cur->ne[0], n = cur->ne[1];
    cur = ggml_reshape_3d(ctx, cur, E, 1, n);
    ggml_tensor * gate, * up;  // [F, k, n]
    if (l.gate_up_exps) {
        ggml_tensor * gate_up = ggml_mul_mat_id(ctx, l.gate_up_exps, cur, r.selected);  // [2F, k, n]
        const int64_t F       = gate_up->ne[0] / 2;
        gate = ggml_view_3d(ctx, gate_up, F, gate_up->ne[1], n, gate_up->nb[1], gate_up->nb[2], 0);
        up   = ggml_view_3d(ctx, gate_up, F, gate_up->ne[1], n, gate_up->nb[1], gate_up->nb[2], F * gate_up->nb[0]);
    } else {
        up   = ggml_mul_mat_id(ctx, l.up_exps, cur, r.selected);
        gate = ggml_mul_mat_id(ctx, l.gate_exps, cur, r.selected);
    }
    ggml_tensor * experts = ggml_mul_mat_id(ctx, l.down_exps, ggml_swiglu_split(ctx, gate, up), r.selected);
    return ggml_mul(ctx, experts, r.weights);  // [E, k, n]
}

// experts: [E, k, n] -> their sum over the k slots [E, n]: views first, then the adds in slot order (as llama.cpp
// orders them, the pattern CUDA's fused weighted reduction matches)
ggml_tensor * build_slot_sum(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * experts) {
    const int64_t              E = experts->ne[0], k = experts->ne[1], n = experts->ne[2];
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
    return k == 1 ? ggml_cont(ctx, out) : out;  // a view of one slot is not contiguous
}

}  // namespace

// cur: [E, n] -> [E, n]: routing (X probabilities -> top k), the k experts weighted and summed, then the shared
// expert's SwiGLU [E, n] times sigmoid(gate_inp_shexp . cur) [1, n] added
ggml_tensor * build_moe_ffn(ggml_context * ctx, ggml_cgraph * gf, const moe_layer & l, const moe_hparams & hp,
                            ggml_tensor * cur, int il) {
    const routing r       = build_routing(ctx, gf, l, hp, cur, il);
    ggml_tensor * experts = build_routed_experts(ctx, l, r, cur);
    ggml_format_name(experts, "ffn_moe_weighted-%d", il);
    ggml_build_forward_expand(gf, experts);
    ggml_tensor * out = build_slot_sum(ctx, gf, experts);
    ggml_format_name(out, "ffn_moe_out-%d", il);
    if (!l.gate_inp_shexp) {
        return out;
    }
    ggml_tensor * shared = build_swiglu_ffn(ctx, cur, l.gate_shexp, l.up_shexp, l.down_shexp);     // [E, n]
    ggml_tensor * gate   = ggml_sigmoid(ctx, ggml_mul_mat(ctx, l.gate_inp_shexp, cur));           // [1, n]
    out                  = ggml_add(ctx, out, ggml_mul(ctx, shared, gate));
    ggml_format_name(out, "ffn_out-%d", il);
    return out;
}

}  // namespace pdf
