#include "models/delta_net_batch.h"

namespace pdf {

bool chains_of_one_length(const std::vector<sequence_part> & parts) {
    if (parts.size() < 2) {
        return false;
    }
    for (size_t i = 0; i < parts.size(); ++i) {
        const sequence_part & p = parts[i];
        if (!p.recurrent->tree_levels.empty() || p.recurrent->ssm_split_at != 0 || p.n != parts[0].n ||
            p.first != (int64_t) i * parts[0].n) {
            return false;
        }
    }
    return true;
}

// [a, b, n*N] (token rows contiguous) -> [a, b, n, N]
static ggml_tensor * by_sequence(ggml_context * ctx, ggml_tensor * t, int64_t n, int64_t N) {
    return ggml_view_4d(ctx, t, t->ne[0], t->ne[1], n, N, t->nb[1], t->nb[2], t->nb[2] * n, 0);
}

ggml_tensor * build_conv_chains(ggml_context * ctx, ggml_cgraph * gf, const std::vector<sequence_part> & parts,
                                int il, ggml_tensor * x, ggml_tensor * kernel) {
    const int64_t C = x->ne[0], N = (int64_t) parts.size(), n = parts[0].n;
    std::vector<ggml_tensor *> windows;
    for (const sequence_part & p : parts) {
        ggml_tensor * w = read_conv_window(ctx, gf, *p.recurrent, *p.st, il, token_range(ctx, x, 1, p.first, p.n),
                                           kernel->ne[0]);  // [C, W]
        windows.push_back(w);
    }
    return build_ssm_conv(ctx, stack_sequences(ctx, windows), ggml_reshape_3d(ctx, x, C, n, N), kernel);
}

ggml_tensor * build_gated_delta_net_chains(ggml_context * ctx, ggml_cgraph * gf,
                                           const std::vector<sequence_part> & parts, int il, ggml_tensor * q,
                                           ggml_tensor * k, ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) {
    const int64_t S = v->ne[0], Hv = v->ne[1], N = (int64_t) parts.size(), n = parts[0].n, D = S * S * Hv;
    const size_t  f = sizeof(float);
    std::vector<ggml_tensor *> states;  // [D, 1] each
    for (const sequence_part & p : parts) {
        const state_tensors & st = *p.st;
        states.push_back(ggml_get_rows(ctx, st.ssm[il], p.recurrent->ssm_row));
        if (p.recurrent->keep_steps) {
            keep_delta_steps(ctx, gf, st, il, token_range(ctx, q, 2, p.first, n), token_range(ctx, k, 2, p.first, n),
                             token_range(ctx, v, 2, p.first, n), token_range(ctx, g, 2, p.first, n),
                             token_range(ctx, beta, 2, p.first, n), 0);
        }
    }
    ggml_tensor * s0  = ggml_reshape_4d(ctx, stack_sequences(ctx, states), S, S, Hv, N);
    ggml_tensor * out = ggml_gated_delta_net(ctx, by_sequence(ctx, q, n, N), by_sequence(ctx, k, n, N),
                                             by_sequence(ctx, v, n, N), by_sequence(ctx, g, n, N),
                                             by_sequence(ctx, beta, n, N), s0, 1);
    // out: [S*Hv, n*N + S*N]: every sequence's outputs, then each one's state after its last token ([D] each)
    for (size_t i = 0; i < parts.size(); ++i) {
        const sequence_part & p     = parts[i];
        ggml_tensor *         after = ggml_view_2d(ctx, out, D, 1, D * f, (S * Hv * n * N + (int64_t) i * D) * f);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, p.st->ssm[il], after, p.recurrent->ssm_out_row));
    }
    return ggml_view_3d(ctx, out, S, Hv, n * N, S * f, S * Hv * f, 0);
}

}  // namespace pdf
