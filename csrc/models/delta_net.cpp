#include "models/delta_net.h"

#include <algorithm>
#include <cmath>

namespace pdf {

ggml_tensor * build_l2_norm(ggml_context * ctx, ggml_tensor * x, float eps) {
    const float n = (float) x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / n), 1.0f / std::sqrt(n));
}

ggml_tensor * build_conv_chain(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const state_tensors & st,
                               int il, ggml_tensor * x, ggml_tensor * kernel) {
    // x: [C, n] (contiguous, time = rows); the buffer holds the last inputs as rows, the window is the W rows
    // in.conv_rows of it
    const int64_t C      = x->ne[0];
    const int64_t n      = x->ne[1];
    const int64_t W      = kernel->ne[0] - 1;
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

ggml_tensor * build_conv_tree(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const state_tensors & st,
                              int il, ggml_tensor * x, ggml_tensor * kernel_t) {
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
    return ggml_silu(ctx, y);  // [C, n]
}

// [a, b, n] (rows may be strided) -> [a, b, n, 1]
static ggml_tensor * as_4d(ggml_context * ctx, ggml_tensor * t) {
    return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], t->ne[2], 1, t->nb[1], t->nb[2], t->nb[2] * t->ne[2], 0);
}

ggml_tensor * build_gated_delta_net(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                    ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) {
    const int64_t S   = v->ne[0];
    const int64_t Hv  = v->ne[1];
    const int64_t n   = v->ne[2];
    const int64_t D   = S * S * Hv;
    ggml_tensor * buf = st.ssm[il];  // [D, n_rollback+1]

    ggml_tensor * state = ggml_get_rows(ctx, buf, in.ssm_row);  // [D, 1]
    const int64_t K     = in.ssm_snapshot_rows->ne[0];
    ggml_tensor * out   = ggml_gated_delta_net(ctx, as_4d(ctx, q), as_4d(ctx, k), as_4d(ctx, v), g, beta,
                                               ggml_reshape_4d(ctx, state, S, S, Hv, 1), K);
    // out: [S*Hv, n + K*S]: the outputs, then K states (state after token n-s in slot s)
    const size_t  f         = ggml_element_size(out);
    ggml_tensor * snapshots = ggml_view_2d(ctx, out, D, K, D * f, S * Hv * n * f);
    // into rows other than the input's, which thus stays the state "as of no token" without a copy
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, buf, snapshots, in.ssm_snapshot_rows));
    return ggml_view_3d(ctx, out, S, Hv, n, S * f, S * Hv * f, 0);
}

ggml_tensor * build_gated_delta_net_tree(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                         const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                         ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) {
    const int64_t S   = v->ne[0];
    const int64_t Hv  = v->ne[1];
    const int64_t n   = v->ne[2];
    const int64_t D   = S * S * Hv;
    ggml_tensor * buf = st.ssm[il];  // [D, n_rollback+1]
    const size_t  f   = sizeof(float);

    // the nodes of depth d: rows [off, off+nd) as nd sequences of one token: [a, b, 1, nd]
    auto level = [ctx](ggml_tensor * t, int64_t off, int64_t nd) {
        return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], 1, nd, t->nb[1], t->nb[2], t->nb[2], off * t->nb[2]);
    };
    ggml_tensor * out    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, S * Hv, n);  // every node's output, filled below
    ggml_tensor * states = nullptr;                                            // [D, n_{d-1}]: the level before
    const int64_t n0     = in.tree_levels[0];
    int64_t       off    = 0;
    for (int nd : in.tree_levels) {
        ggml_tensor * start =
            off == 0 ? ggml_get_rows(ctx, buf, in.tree_root_state)  // [D, n0]: the committed state
                     : ggml_get_rows(ctx, states, ggml_view_1d(ctx, in.tree_parent, nd, (off - n0) * sizeof(int32_t)));
        ggml_tensor * o = ggml_gated_delta_net(ctx, level(q, off, nd), level(k, off, nd), level(v, off, nd),
                                               level(g, off, nd), level(beta, off, nd),
                                               ggml_reshape_4d(ctx, start, S, S, Hv, nd), 1);
        // o: [S*Hv, nd + S*nd]: the nd outputs, then the nd states
        ggml_tensor * o_nodes = ggml_view_2d(ctx, o, S * Hv, nd, S * Hv * f, 0);
        states                = ggml_view_2d(ctx, o, D, nd, D * f, S * Hv * nd * f);
        out = ggml_set_rows(ctx, out, o_nodes, ggml_view_1d(ctx, in.tree_out_rows, nd, off * sizeof(int64_t)));
        ggml_build_forward_expand(
            gf, ggml_set_rows(ctx, buf, states, ggml_view_1d(ctx, in.tree_state_rows, nd, off * sizeof(int64_t))));
        off += nd;
    }
    return ggml_reshape_3d(ctx, out, S, Hv, n);
}

}  // namespace pdf
