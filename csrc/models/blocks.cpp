#include "models/blocks.h"
#include "core/error.h"

#include <algorithm>

namespace pdf {

ggml_tensor * build_rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), w);
}

ggml_tensor * build_swiglu_ffn(ggml_context * ctx, ggml_tensor * x, ggml_tensor * gate, ggml_tensor * up,
                               ggml_tensor * down) {
    ggml_tensor * g = ggml_mul_mat(ctx, gate, x);  // [n_ff, n]
    ggml_tensor * u = ggml_mul_mat(ctx, up, x);    // [n_ff, n]
    return ggml_mul_mat(ctx, down, ggml_swiglu_split(ctx, g, u));
}

swiglu_weights declare_swiglu(weights & w, int64_t n_embd, int64_t n_ff, int il) {
    auto name = [il](const char * s) { return format("blk.%d.%s", il, s); };
    return {w.require(name("ffn_gate.weight"), {n_embd, n_ff}, il, WEIGHT_USE_MATMUL),
            w.require(name("ffn_up.weight"), {n_embd, n_ff}, il, WEIGHT_USE_MATMUL),
            w.require(name("ffn_down.weight"), {n_ff, n_embd}, il, WEIGHT_USE_MATMUL)};
}

ggml_tensor * build_mixer_residual(ggml_context * ctx, ggml_tensor * x, ggml_tensor * norm, float eps,
                                   bool last_token_only, const std::function<ggml_tensor *(ggml_tensor *)> & mixer,
                                   const char * name, int il) {
    ggml_tensor * cur = mixer(build_rms_norm(ctx, x, norm, eps));
    if (last_token_only) {
        x = last_token(ctx, x);
    }
    x = ggml_add(ctx, cur, x);
    ggml_format_name(x, "%s-%d", name, il);
    return x;
}

ggml_tensor * build_ffn_residual(ggml_context * ctx, ggml_tensor * x, ggml_tensor * norm, float eps,
                                 const std::function<ggml_tensor *(ggml_tensor *)> & ffn, int il) {
    x = ggml_add(ctx, ffn(build_rms_norm(ctx, x, norm, eps)), x);
    ggml_format_name(x, "l_out-%d", il);
    return x;
}

ggml_tensor * last_token(ggml_context * ctx, ggml_tensor * x) {
    const int     d = ggml_n_dims(x) - 1;  // the token dimension
    const int64_t n = x->ne[d];
    if (d == 1) {
        return ggml_view_2d(ctx, x, x->ne[0], 1, x->nb[1], (n - 1) * x->nb[1]);
    }
    GGML_ASSERT(d == 2);
    return ggml_view_3d(ctx, x, x->ne[0], x->ne[1], 1, x->nb[1], x->nb[2], (n - 1) * x->nb[2]);
}

bool last_layer_for_last_token_only(const eval_inputs & in, int n_layer) {
    const auto & c = in.capture_layers;
    return in.sequences.empty() && !in.all_outputs && in.n_tokens > 1 && std::find(c.begin(), c.end(), n_layer) == c.end();
}

}  // namespace pdf
