#include "models/delta_net.h"

#include <algorithm>
#include <cmath>

namespace pdf {

ggml_tensor * build_l2_norm(ggml_context * ctx, ggml_tensor * x, float eps) {
    const float n = (float) x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / n), 1.0f / std::sqrt(n));
}

ggml_tensor * read_conv_window(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                               const state_tensors & st, int il, ggml_tensor * x, int64_t d_conv) {
    // x: [C, n] (time = rows); the buffer holds the last inputs as rows, the window is the W rows in.conv_rows
    // of it
    const int64_t C      = x->ne[0];
    const int64_t n      = x->ne[1];
    const int64_t W      = d_conv - 1;
    ggml_tensor * buf    = st.conv[il];  // [C, W+n_rollback]
    ggml_tensor * window = ggml_get_rows(ctx, buf, in.conv_rows);  // [C, W]
    // the window is read out before the writes below overwrite buffer rows (graph order is execution order)
    ggml_build_forward_expand(gf, window);

    // keep the rows of [window ‖ x] that later commits can start from: the last W+min(n, n_rollback)
    const int64_t from = in.conv_keep_from;
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
    return window;
}

ggml_tensor * build_ssm_conv(ggml_context * ctx, ggml_tensor * window, ggml_tensor * x, ggml_tensor * kernel) {
    const int64_t C = x->ne[0], n = x->ne[1], N = x->ne[2], W = window->ne[1];
    // ssm_conv wants time innermost: [W+n, C, N]. One concat of the two transposed views builds it; split into
    // [W+n, C/k, k, N] because ggml's CPU concat runs its outer dimensions in parallel (and, unlike a copy of a
    // transposed view, moves the elements in a typed loop rather than one memcpy each)
    int64_t k = 16;
    while (C % k != 0) {
        k /= 2;
    }
    auto time_major = [&](ggml_tensor * t) {  // [C, T, N] -> [T, C/k, k, N]
        ggml_tensor * t4 = ggml_view_4d(ctx, t, C / k, k, t->ne[1], N, (C / k) * t->nb[0], t->nb[1], t->nb[2], 0);
        return ggml_permute(ctx, t4, 1, 2, 0, 3);
    };
    ggml_tensor * sx = ggml_concat(ctx, time_major(window), time_major(x), 0);  // [W+n, C/k, k, N]
    sx               = ggml_reshape_3d(ctx, sx, W + n, C, N);
    return ggml_reshape_2d(ctx, ggml_ssm_conv(ctx, sx, kernel), C, n * N);  // [C, n, N] -> [C, n*N]
}

ggml_tensor * build_conv_chain(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                               const state_tensors & st, int il, ggml_tensor * x, ggml_tensor * kernel) {
    ggml_tensor * window = read_conv_window(ctx, gf, in, st, il, x, kernel->ne[0]);  // [C, W]
    return build_ssm_conv(ctx, ggml_reshape_3d(ctx, window, window->ne[0], window->ne[1], 1),
                          ggml_view_3d(ctx, x, x->ne[0], x->ne[1], 1, x->nb[1], x->nb[1] * x->ne[1], 0), kernel);
}

ggml_tensor * build_conv_tree(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                              const state_tensors & st, int il, ggml_tensor * x, ggml_tensor * kernel_t) {
    const int64_t C   = x->ne[0];
    const int64_t n   = x->ne[1];
    const int64_t K   = kernel_t->ne[1];  // d_conv
    const int64_t W   = K - 1;
    ggml_tensor * buf = st.conv[il];  // [C, W+n_rollback]
    // [window ‖ x]: a node's taps are rows of it; written back whole, so that a commit can name any node's
    // window by rows (the write depends on the window read, so it cannot overtake it)
    ggml_tensor * wx = ggml_concat(ctx, ggml_get_rows(ctx, buf, in.conv_rows), x, 1);  // [C, W+n]
    ggml_build_forward_expand(gf, ggml_cpy(ctx, wx, ggml_view_2d(ctx, buf, C, W + n, buf->nb[1], 0)));

    ggml_tensor * taps = ggml_reshape_3d(ctx, ggml_get_rows(ctx, wx, in.conv_taps), C, K, n);     // [C, K, n]
    ggml_tensor * prod = ggml_mul(ctx, taps, ggml_reshape_3d(ctx, kernel_t, C, K, 1));          // [C, K, n]
    // sum over the taps in kernel order (oldest first), as ssm_conv does
    auto tap = [&](int64_t j) { return ggml_view_2d(ctx, prod, C, n, prod->nb[2], j * prod->nb[1]); };
    ggml_tensor * y = tap(0);
    for (int64_t j = 1; j < K; ++j) {
        y = ggml_add(ctx, y, tap(j));
    }
    return y;  // [C, n]
}

// [a, b, n] (rows may be strided) -> [a, b, n, 1]
static ggml_tensor * as_4d(ggml_context * ctx, ggml_tensor * t) {
    return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], t->ne[2], 1, t->nb[1], t->nb[2], t->nb[2] * t->ne[2], 0);
}

// the sizes a delta rule reads off v ([S, Hv, n]) and the layer's state rows it reads and writes
struct delta_net_state {
    int64_t       S, Hv, n;
    int64_t       D;    // one token's state: S * S * Hv floats
    ggml_tensor * buf;  // st.ssm[il]: [D, 2]
};
static delta_net_state state_of(const ggml_tensor * v, const state_tensors & st, int il) {
    return {v->ne[0], v->ne[1], v->ne[2], v->ne[0] * v->ne[0] * v->ne[1], st.ssm[il]};
}

// tokens [from, from+m) of a per-token tensor [a, b, n] as m one-token steps of one sequence: [a, b, m, 1]
static ggml_tensor * steps_of(ggml_context * ctx, ggml_tensor * t, int64_t from, int64_t m) {
    return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], m, 1, t->nb[1], t->nb[2], t->nb[2] * m, from * t->nb[2]);
}

// the gated-delta-net inputs of tokens from .. n-1 into step rows 0 .. n-1-from, for a commit of some of them
// to recompute their state from (each token's q, k, v and g, beta rows are contiguous: [a, b, n] views)
void keep_delta_steps(ggml_context * ctx, ggml_cgraph * gf, const state_tensors & st, int il, ggml_tensor * q,
                      ggml_tensor * k, ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta, int64_t from) {
    const int64_t m = v->ne[2] - from;
    auto put = [&](ggml_tensor * t, ggml_tensor * buf, int64_t offset) {
        const int64_t w   = t->ne[0] * t->ne[1];
        ggml_tensor * src = ggml_view_2d(ctx, t, w, m, t->nb[2], from * t->nb[2]);
        ggml_tensor * dst = ggml_view_2d(ctx, buf, w, m, buf->nb[1], offset * ggml_element_size(buf));
        ggml_build_forward_expand(gf, ggml_cpy(ctx, src, dst));
    };
    const int64_t S = v->ne[0], Hk = q->ne[1];
    put(q, st.step_qkv[il], 0);  // [2*S*Hk + S*Hv, rows]
    put(k, st.step_qkv[il], S * Hk);
    put(v, st.step_qkv[il], 2 * S * Hk);
    put(g, st.step_g[il], 0);
    put(beta, st.step_beta[il], 0);
}

ggml_tensor * build_gated_delta_net(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                                    const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                    ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) {
    const auto [S, Hv, n, D, buf] = state_of(v, st, il);
    const int64_t b               = in.ssm_split_at;
    const size_t  f               = sizeof(float);
    if (in.keep_steps) {
        keep_delta_steps(ctx, gf, st, il, q, k, v, g, beta, b);
    }
    // tokens [from, from+m) from state s0: out [S*Hv, m + S]: the m outputs, then the state after them
    auto run = [&](int64_t from, int64_t m, ggml_tensor * s0) {
        return ggml_gated_delta_net(ctx, steps_of(ctx, q, from, m), steps_of(ctx, k, from, m),
                                    steps_of(ctx, v, from, m), steps_of(ctx, g, from, m),
                                    steps_of(ctx, beta, from, m), ggml_reshape_4d(ctx, s0, S, S, Hv, 1), 1);
    };
    auto outputs   = [&](ggml_tensor * out, int64_t m) { return ggml_view_3d(ctx, out, S, Hv, m, S * f, S * Hv * f, 0); };
    auto state_out = [&](ggml_tensor * out, int64_t m) { return ggml_view_2d(ctx, out, D, 1, D * f, S * Hv * m * f); };

    ggml_tensor * state = ggml_get_rows(ctx, buf, in.ssm_row);  // [D, 1]
    ggml_tensor * head  = run(0, b > 0 ? b : n, state);
    // the state after token b (b = 0: after the last) into a row other than the input's, which thus stays the
    // state "as of no token" without a copy
    ggml_tensor * kept  = state_out(head, b > 0 ? b : n);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, buf, kept, in.ssm_out_row));
    if (b == 0) {
        return outputs(head, n);
    }
    ggml_tensor * tail = run(b, n - b, kept);  // (its final state is recomputed by the commit that keeps it)
    return ggml_concat(ctx, outputs(head, b), outputs(tail, n - b), 2);
}

ggml_tensor * build_state_after_steps(ggml_context * ctx, ggml_cgraph * gf, const state_tensors & st,
                                      const recurrent_layer_desc & l, ggml_tensor * steps, ggml_tensor * from,
                                      ggml_tensor * to) {
    const int64_t S = l.head_dim, Hk = l.n_k_heads, Hv = l.n_v_heads, L = steps->ne[0], D = l.ssm_size;
    const size_t  f = sizeof(float);
    ggml_tensor * qkv = ggml_get_rows(ctx, st.step_qkv[l.il], steps);  // [2*S*Hk + S*Hv, L]
    auto part = [&](int64_t H, int64_t offset) {                        // [S, H, L, 1]
        return ggml_view_4d(ctx, qkv, S, H, L, 1, S * f, qkv->nb[1], qkv->nb[1] * L, offset * f);
    };
    auto per_head = [&](ggml_tensor * buf) {  // [1, Hv, L, 1]
        return ggml_reshape_4d(ctx, ggml_get_rows(ctx, buf, steps), 1, Hv, L, 1);
    };
    ggml_tensor * state = ggml_reshape_4d(ctx, ggml_get_rows(ctx, st.ssm[l.il], from), S, S, Hv, 1);
    ggml_tensor * out   = ggml_gated_delta_net(ctx, part(Hk, 0), part(Hk, S * Hk), part(Hv, 2 * S * Hk),
                                               per_head(st.step_g[l.il]), per_head(st.step_beta[l.il]), state, 1);
    ggml_tensor * last  = ggml_view_2d(ctx, out, D, 1, D * f, S * Hv * L * f);
    ggml_tensor * kept  = ggml_set_rows(ctx, st.ssm[l.il], last, to);
    ggml_build_forward_expand(gf, kept);
    return kept;
}

// Per value head h (q and k heads tiled over the value heads as ggml_gated_delta_net does), with the state M
// [S(k), S(v)] (M[j][i] at j*S + i, as the fused op keeps it), a chunk of C tokens whose in-chunk cumulative
// log-decay is G_t (Γ_t = exp(G_t)) and M_0 the state it starts from:
//   δ_t  = β_t (v_t - Γ_t M_0 k_t - Σ_{s<t} (Γ_t/Γ_s)(k_t·k_s) δ_s)   i.e. (I + A) Δ = Vβ - diag(βΓ) K M_0ᵀ
//   Δ    = U - W M_0ᵀ, with T = (I + A)⁻¹, U = T·Vβ, W = T·diag(βΓ)·K       (A strictly lower, per chunk)
//   o_t  = scale (Γ_t M_0 q_t + Σ_{s<=t} (Γ_t/Γ_s)(q_t·k_s) δ_s)
//   M_C  = Γ_C M_0 + Σ_s (Γ_C/Γ_s) δ_s k_sᵀ
// Everything but the three lines that involve M_0 is computed for all chunks at once; those run chunk by chunk.
// Padding tokens (to a multiple of C) have β = 0 and g = 0: they change nothing.
ggml_tensor * build_gated_delta_net_chunked(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                                            const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                            ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) {
    const int64_t S = v->ne[0], Hv = v->ne[1], n = v->ne[2], Hk = q->ne[1];
    const int64_t C = DELTA_NET_CHUNK, NC = (n + C - 1) / C, pad = NC * C - n;
    const int64_t D   = S * S * Hv;
    ggml_tensor * buf = st.ssm[il];  // [D, 2]
    GGML_ASSERT(in.ssm_split_at == 0 && !in.keep_steps);

    // tokens innermost per head: [S, n, Hv] (q, k tiled from Hk heads: value head h reads key head h % Hk)
    auto per_head = [&](ggml_tensor * t, int64_t H) {  // [S, H, n] -> [S, n+pad, H]
        ggml_tensor * c = ggml_cont(ctx, ggml_permute(ctx, as_4d(ctx, t), 0, 2, 1, 3));  // [S, n, H, 1]
        if (H != Hv) {
            c = ggml_repeat_4d(ctx, c, S, n, Hv, 1);
        }
        return ggml_reshape_4d(ctx, ggml_pad(ctx, c, 0, pad, 0, 0), S, C, NC, Hv);
    };
    const float   scale = 1.0f / std::sqrt((float) S);
    ggml_tensor * Q     = per_head(ggml_scale(ctx, q, scale), Hk);  // [S, C, NC, Hv]
    ggml_tensor * K     = per_head(k, Hk);
    ggml_tensor * V     = per_head(v, Hv);
    auto per_token = [&](ggml_tensor * t) {  // [1, Hv, n] -> [C, NC, Hv]: tokens innermost
        ggml_tensor * c = ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_2d(ctx, t, Hv, n)));  // [n, Hv]
        return ggml_reshape_3d(ctx, ggml_pad(ctx, c, pad, 0, 0, 0), C, NC, Hv);
    };
    ggml_tensor * B = per_token(beta);
    ggml_tensor * G     = ggml_cumsum(ctx, per_token(g));       // [C, NC, Hv]: G_t within each chunk
    ggml_tensor * G_tok = ggml_reshape_4d(ctx, G, 1, C, NC, Hv);  // one per token along ne1
    ggml_tensor * G_s   = ggml_reshape_4d(ctx, G, C, 1, NC, Hv);  // G at ne0
    ggml_tensor * G_t   = ggml_repeat_4d(ctx, G_tok, C, C, NC, Hv);  // G at ne1
    // decay[s, t] = Γ_t/Γ_s for s <= t (ne0 = s, ne1 = t), zeroed above before exp so nothing overflows
    ggml_tensor * decay = ggml_exp(ctx, ggml_tri(ctx, ggml_sub(ctx, G_t, G_s), GGML_TRI_TYPE_LOWER_DIAG));
    ggml_tensor * B_t   = ggml_reshape_4d(ctx, B, 1, C, NC, Hv);
    ggml_tensor * Gam_t = ggml_exp(ctx, G_tok);  // Γ_t per token (ne1)

    // A[t][s] = β_t Γ_t/Γ_s k_t·k_s, s < t; T - I = (I + A)⁻¹(-A), so T = that + I
    ggml_tensor * A   = ggml_tri(ctx, ggml_mul(ctx, ggml_mul(ctx, ggml_mul_mat(ctx, K, K), decay), B_t),
                                 GGML_TRI_TYPE_LOWER);  // [C(s), C(t), NC, Hv]
    ggml_tensor * eye = ggml_diag(ctx, ggml_fill(ctx, ggml_view_1d(ctx, A, C, 0), 1.0f));  // [C, C]
    ggml_tensor * T   = ggml_add(ctx, ggml_solve_tri(ctx, ggml_add(ctx, A, eye), ggml_neg(ctx, A), true, true, false),
                                 eye);
    auto tokens_first = [&](ggml_tensor * t) { return ggml_cont(ctx, ggml_transpose(ctx, t)); };  // [S,C] -> [C,S]
    ggml_tensor * U = ggml_mul_mat(ctx, tokens_first(ggml_mul(ctx, V, B_t)), T);                  // [S(v), C(t)]
    ggml_tensor * W = ggml_mul_mat(ctx, tokens_first(ggml_mul(ctx, K, ggml_mul(ctx, B_t, Gam_t))), T);  // [S(k), C]
    // P[s, t] = Γ_t/Γ_s q_t·k_s for s <= t
    ggml_tensor * P = ggml_tri(ctx, ggml_mul(ctx, ggml_mul_mat(ctx, K, Q), decay), GGML_TRI_TYPE_LOWER_DIAG);
    ggml_tensor * QG = ggml_mul(ctx, Q, Gam_t);  // Γ_t q_t
    // the chunk's last decay Γ_C, and k_s Γ_C/Γ_s (tokens first, for the state update)
    ggml_tensor * G_last = ggml_cont(ctx, ggml_view_4d(ctx, G, 1, 1, NC, Hv, G->nb[1], G->nb[1], G->nb[2],
                                                       (C - 1) * G->nb[0]));  // [1, 1, NC, Hv]
    ggml_tensor * Gam_C  = ggml_exp(ctx, G_last);
    ggml_tensor * KG     = tokens_first(ggml_mul(ctx, K, ggml_exp(ctx, ggml_neg(ctx, ggml_sub(ctx, G_tok, G_last)))));

    ggml_tensor * M   = ggml_reshape_4d(ctx, ggml_get_rows(ctx, buf, in.ssm_row), S, S, 1, Hv);  // M_0
    ggml_tensor * out = U;  // chunk c's outputs overwrite U's chunk c once it has been read
    auto chunk = [&](ggml_tensor * t, int64_t c) {
        return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], 1, Hv, t->nb[1], t->nb[2], t->nb[3], c * t->nb[2]);
    };
    for (int64_t c = 0; c < NC; ++c) {
        ggml_tensor * delta = ggml_sub(ctx, chunk(U, c), ggml_mul_mat(ctx, M, chunk(W, c)));  // [S(v), C]
        ggml_tensor * delta_t = tokens_first(delta);                                          // [C, S(v)]
        ggml_tensor * o = ggml_add(ctx, ggml_mul_mat(ctx, M, chunk(QG, c)), ggml_mul_mat(ctx, delta_t, chunk(P, c)));
        out = ggml_set_inplace(ctx, out, o, out->nb[1], out->nb[2], out->nb[3], c * out->nb[2]);
        M   = ggml_add(ctx, ggml_mul(ctx, M, chunk(Gam_C, c)), ggml_mul_mat(ctx, chunk(KG, c), delta_t));
    }
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, buf, ggml_reshape_2d(ctx, M, D, 1), in.ssm_out_row));
    // [S, C*NC, Hv] -> the first n tokens -> [S, Hv, n]
    ggml_tensor * o = ggml_view_3d(ctx, out, S, n, Hv, out->nb[1], out->nb[3], 0);
    return ggml_cont(ctx, ggml_permute(ctx, o, 0, 2, 1, 3));
}

ggml_tensor * build_gated_delta_net_tree(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                                         const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                         ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) {
    const auto [S, Hv, n, D, buf] = state_of(v, st, il);
    const size_t f                = sizeof(float);
    keep_delta_steps(ctx, gf, st, il, q, k, v, g, beta, 0);  // a commit recomputes its path's state from them

    // the nodes of depth d: rows [off, off+nd) as nd sequences of one token: [a, b, 1, nd]
    auto level = [ctx](ggml_tensor * t, int64_t off, int64_t nd) {
        return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], 1, nd, t->nb[1], t->nb[2], t->nb[2], off * t->nb[2]);
    };
    ggml_tensor * out    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, S * Hv, n);  // every node's output, filled below
    ggml_tensor * states = nullptr;                                            // [D, n_{d-1}]: the level before
    const int64_t n0     = in.tree_levels[0];
    int64_t       off    = 0;
    size_t        depth  = 0;
    for (int nd : in.tree_levels) {
        ggml_tensor * start =
            off == 0 ? ggml_get_rows(ctx, buf, in.tree_root_state)  // [D, n0]: the committed state
                     : ggml_get_rows(ctx, states, ggml_view_1d(ctx, in.tree_parent, nd, (off - n0) * sizeof(int32_t)));
        ggml_tensor * o = ggml_gated_delta_net(ctx, level(q, off, nd), level(k, off, nd), level(v, off, nd),
                                               level(g, off, nd), level(beta, off, nd),
                                               ggml_reshape_4d(ctx, start, S, S, Hv, nd), 1);
        // o: [S*Hv, nd + S*nd]: the nd outputs, then the nd states (named for tests, which compare a commit's
        // recomputed state with these)
        ggml_format_name(o, "gdn_tree-%d-%zu", il, depth++);
        ggml_tensor * o_nodes = ggml_view_2d(ctx, o, S * Hv, nd, S * Hv * f, 0);
        states                = ggml_view_2d(ctx, o, D, nd, D * f, S * Hv * nd * f);
        out = ggml_set_rows(ctx, out, o_nodes, ggml_view_1d(ctx, in.tree_out_rows, nd, off * sizeof(int64_t)));
        off += nd;
    }
    return ggml_reshape_3d(ctx, out, S, Hv, n);
}

}  // namespace pdf
