#include "models/blocks.h"

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

ggml_tensor * build_rope_neox(ggml_context * ctx, ggml_tensor * x, ggml_tensor * positions, int n_rot,
                              float freq_base, int n_ctx_orig) {
    return ggml_rope_ext(ctx, x, positions, nullptr, n_rot, GGML_ROPE_TYPE_NEOX, n_ctx_orig, freq_base,
                         /*freq_scale*/ 1.0f, /*ext_factor*/ 0.0f, /*attn_factor*/ 1.0f, /*beta_fast*/ 0.0f,
                         /*beta_slow*/ 0.0f);
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
    return !in.all_logits && in.n_tokens > 1 && std::find(c.begin(), c.end(), n_layer) == c.end();
}

// the attended V window (bytes per layer) up to which the CPU uses plain matmul attention (see below), for
// windows counted in steps of SMALL_WINDOW_STEP slots: the bound was chosen with the windows of 256-slot steps,
// and a session attending in finer steps must not move a model onto this path where flash attention is
// faster for it (Qwen3-0.6B decode over its first 128 tokens: ~12% slower)
static constexpr size_t SMALL_WINDOW_BYTES = 256 * 1024;
static constexpr int    SMALL_WINDOW_STEP  = 256;

ggml_tensor * build_kv_attention(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const kv_cache & kv,
                                 int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float scale,
                                 bool last_query_only) {
    const int64_t hd    = q->ne[0];
    const int64_t H     = q->ne[1];
    const int64_t hdv   = v->ne[0];
    const int64_t Hkv   = k->ne[1];
    const int64_t n_new = k->ne[2];
    ggml_tensor * kq_mask = in.kq_mask;  // [n_kv, n_new]
    if (last_query_only) {
        q       = last_token(ctx, q);
        kq_mask = last_token(ctx, kq_mask);
    }
    const int64_t n = q->ne[2];  // queries

    ggml_tensor * k_cache = kv.k(il);  // [hd*Hkv, n_ctx]
    ggml_tensor * v_cache = kv.v(il);  // [hdv*Hkv, n_ctx]

    // the writes come first in the graph so the reads below see them
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, k_cache, ggml_reshape_2d(ctx, k, hd * Hkv, n_new), in.kv_slots));
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, v_cache, ggml_reshape_2d(ctx, v, hdv * Hkv, n_new), in.kv_slots));

    // cache rows 0..n_kv-1 as [hd, n_kv, Hkv]
    ggml_tensor * k_view = ggml_view_3d(ctx, k_cache, hd, Hkv, in.n_kv, ggml_row_size(k_cache->type, hd),
                                        k_cache->nb[1], 0);
    ggml_tensor * v_view = ggml_view_3d(ctx, v_cache, hdv, Hkv, in.n_kv, ggml_row_size(v_cache->type, hdv),
                                        v_cache->nb[1], 0);
    k_view = ggml_permute(ctx, k_view, 0, 2, 1, 3);
    v_view = ggml_permute(ctx, v_view, 0, 2, 1, 3);

    ggml_tensor * q_perm = ggml_permute(ctx, q, 0, 2, 1, 3);  // [hd, n, H]

    // Small attention windows on the CPU: matmuls + softmax (f32 accumulation) instead of ggml's CPU flash
    // attention, whose path for 1..63 queries converts every K/V row per query head and accumulates an f16 V
    // in f16: ~45% of a DFlash round on the trained qwen3 pair. The choice depends only on the window, never
    // on the batch size, so a verify block and single-token decoding round alike (mixing the two kernels
    // made speculative output part from plain decoding on 10 of 16 prompts, q8_0 pair, f16 cache).
    // P·V needs V with the cache rows innermost, i.e. a transposed copy of the window. ggml's CPU copy of a
    // transposed view of the same type moves each element with its own memcpy (17% of a tiny model's decode
    // step at a 1K window), while a copy between two types is a typed loop: so an f16 V is transposed into
    // f32 and converted back (contiguous, vectorized), which made decoding on the demo pair ~1.3x faster. It
    // stays f16 for the matmul: the same numbers as before, which keep our greedy tokens equal to llama.cpp's
    // (an all-f32 P·V parted from them beyond near-ties on q8_0 test models). The copy grows with the window,
    // which is what bounds it (quantized V rows cannot be transposed at all).
    const bool   cpu_cache  = ggml_backend_buffer_is_host(k_cache->buffer);
    const bool   plain_kv   = (k_cache->type == GGML_TYPE_F16 || k_cache->type == GGML_TYPE_F32) &&
                          (v_cache->type == GGML_TYPE_F16 || v_cache->type == GGML_TYPE_F32);
    const size_t v_window   = (size_t) GGML_PAD(in.n_kv, SMALL_WINDOW_STEP) * ggml_row_size(v_cache->type, hdv * Hkv);
    if (cpu_cache && plain_kv && n < 64 && v_window <= SMALL_WINDOW_BYTES) {
        ggml_tensor * kq = ggml_mul_mat(ctx, k_view, q_perm);  // [n_kv, n, H]
        ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
        kq                = ggml_soft_max_ext(ctx, kq, kq_mask, scale, 0.0f);
        ggml_tensor * v_t = ggml_transpose(ctx, v_view);  // [n_kv, hdv, Hkv]
        v_t = v_cache->type == GGML_TYPE_F16 ? ggml_cast(ctx, ggml_cast(ctx, v_t, GGML_TYPE_F32), GGML_TYPE_F16)
                                             : ggml_cont(ctx, v_t);
        ggml_tensor * kqv = ggml_mul_mat(ctx, v_t, kq);  // [hdv, n, H]
        return ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hdv * H, n);  // [hdv*H, n]
    }
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q_perm, k_view, v_view, kq_mask, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    return ggml_reshape_2d(ctx, out, hdv * H, n);  // out: [hdv, H, n]
}

}  // namespace pdf

#include "state/recurrent_state.h"

#include <algorithm>
#include <cmath>

namespace pdf {

ggml_tensor * build_l2_norm(ggml_context * ctx, ggml_tensor * x, float eps) {
    const float n = (float) x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / n), 1.0f / std::sqrt(n));
}

ggml_tensor * build_conv_with_state(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const recurrent_state & rs, int il, ggml_tensor * x, ggml_tensor * kernel) {
    // x: [C, n] (contiguous, time = rows); the buffer holds the last inputs as rows, the window is d_conv-1
    // consecutive rows of it starting at in.conv_rows[0]
    const int64_t C      = x->ne[0];
    const int64_t n      = x->ne[1];
    const int64_t W      = kernel->ne[0] - 1;
    ggml_tensor * buf    = rs.conv(il);  // [C, W+n_rollback]
    ggml_tensor * window = ggml_get_rows(ctx, buf, in.conv_rows);  // [C, W]
    // the window is read out before the writes below overwrite buffer rows (graph order is execution order)
    ggml_build_forward_expand(gf, window);

    // keep the rows of [window ‖ x] that later commits can start from: the last W+min(n, n_rollback)
    const int64_t from = rs.conv_keep_from((int) n);
    int64_t       row  = 0;  // next buffer row written
    if (from < W) {
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_view_2d(ctx, window, C, W - from, window->nb[1],
                                                                 from * window->nb[1]),
                                               ggml_view_2d(ctx, buf, C, W - from, buf->nb[1], 0)));
        row = W - from;
    }
    const int64_t x_from = std::max<int64_t>(0, from - W);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_view_2d(ctx, x, C, n - x_from, x->nb[1], x_from * x->nb[1]),
                                           ggml_view_2d(ctx, buf, C, n - x_from, buf->nb[1], row * buf->nb[1])));

    // ssm_conv wants time innermost: [W+n, C]. One concat of the two transposed views builds it; split into
    // [W+n, C/k, k] because ggml's CPU concat runs its outer dimension in parallel (and, unlike a copy of a
    // transposed view, moves the elements in a typed loop rather than one memcpy each)
    int64_t k = 16;
    while (C % k != 0) {
        k /= 2;
    }
    auto time_major = [&](ggml_tensor * t) {  // [C, T] -> [T, C/k, k]
        ggml_tensor * t3 = ggml_view_3d(ctx, t, C / k, k, t->ne[1], (C / k) * t->nb[0], t->nb[1], 0);
        return ggml_permute(ctx, t3, 1, 2, 0, 3);
    };
    ggml_tensor * sx = ggml_concat(ctx, time_major(window), time_major(x), 0);  // [W+n, C/k, k]
    sx               = ggml_reshape_3d(ctx, sx, W + n, C, 1);
    ggml_tensor * y  = ggml_ssm_conv(ctx, sx, kernel);  // [C, n, 1]
    return ggml_silu(ctx, ggml_reshape_2d(ctx, y, C, n));
}

ggml_tensor * build_gated_delta_net(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const recurrent_state & rs, int il, ggml_tensor * q, ggml_tensor * k,
                                    ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) {
    const int64_t S  = v->ne[0];
    const int64_t Hv = v->ne[1];
    const int64_t n  = v->ne[2];
    const int64_t D  = S * S * Hv;
    ggml_tensor * buf = rs.ssm(il);  // [D, n_rollback+1]

    // [a, b, n] (rows may be strided) -> [a, b, n, 1]
    auto as_4d = [ctx](ggml_tensor * t) {
        return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], t->ne[2], 1, t->nb[1], t->nb[2], t->nb[2] * t->ne[2], 0);
    };
    ggml_tensor * state = ggml_get_rows(ctx, buf, in.ssm_row);  // [D, 1]
    const int64_t K     = rs.n_snapshots((int) n);
    ggml_tensor * out   = ggml_gated_delta_net(ctx, as_4d(q), as_4d(k), as_4d(v), g, beta,
                                               ggml_reshape_4d(ctx, state, S, S, Hv, 1), K);
    // out: [S*Hv, n + K*S]: the outputs, then K states (state after token n-s in slot s)
    const size_t  f = ggml_element_size(out);
    ggml_tensor * snapshots = ggml_view_2d(ctx, out, D, K, D * f, S * Hv * n * f);
    // into rows other than the input's, which thus stays the state "as of no token" without a copy
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, buf, snapshots, in.ssm_snapshot_rows));
    return ggml_view_3d(ctx, out, S, Hv, n, S * f, S * Hv * f, 0);
}

}  // namespace pdf
