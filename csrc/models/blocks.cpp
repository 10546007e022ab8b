#include "models/blocks.h"

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

ggml_tensor * build_rope_neox(ggml_context * ctx, ggml_tensor * x, ggml_tensor * positions, int n_rot,
                              float freq_base, int n_ctx_orig) {
    return ggml_rope_ext(ctx, x, positions, nullptr, n_rot, GGML_ROPE_TYPE_NEOX, n_ctx_orig, freq_base,
                         /*freq_scale*/ 1.0f, /*ext_factor*/ 0.0f, /*attn_factor*/ 1.0f, /*beta_fast*/ 0.0f,
                         /*beta_slow*/ 0.0f);
}

ggml_tensor * build_kv_attention(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const kv_cache & kv,
                                 int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float scale) {
    const int64_t hd  = q->ne[0];
    const int64_t H   = q->ne[1];
    const int64_t hdv = v->ne[0];
    const int64_t Hkv = k->ne[1];
    const int64_t n   = q->ne[2];

    ggml_tensor * k_cache = kv.k(il);  // [hd*Hkv, n_ctx]
    ggml_tensor * v_cache = kv.v(il);  // [hdv*Hkv, n_ctx]

    // the writes come first in the graph so the reads below see them
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, k_cache, ggml_reshape_2d(ctx, k, hd * Hkv, n), in.kv_slots));
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, v_cache, ggml_reshape_2d(ctx, v, hdv * Hkv, n), in.kv_slots));

    // cache rows 0..n_kv-1 as [hd, n_kv, Hkv]
    ggml_tensor * k_view = ggml_view_3d(ctx, k_cache, hd, Hkv, in.n_kv, ggml_row_size(k_cache->type, hd),
                                        k_cache->nb[1], 0);
    ggml_tensor * v_view = ggml_view_3d(ctx, v_cache, hdv, Hkv, in.n_kv, ggml_row_size(v_cache->type, hdv),
                                        v_cache->nb[1], 0);
    k_view = ggml_permute(ctx, k_view, 0, 2, 1, 3);
    v_view = ggml_permute(ctx, v_view, 0, 2, 1, 3);

    ggml_tensor * q_perm = ggml_permute(ctx, q, 0, 2, 1, 3);  // [hd, n, H]
    ggml_tensor * out    = ggml_flash_attn_ext(ctx, q_perm, k_view, v_view, in.kq_mask, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    return ggml_reshape_2d(ctx, out, hdv * H, n);  // out: [hdv, H, n]
}

}  // namespace pdf
