#include "models/sequences.h"

#include <cstdint>

namespace pdf {

std::vector<sequence_part> sequence_parts(const eval_inputs & in, const state_tensors & st) {
    if (in.sequences.empty()) {
        return {{0, in.n_tokens, &in.kv, &in.recurrent, &st}};
    }
    std::vector<sequence_part> parts;
    for (const sequence_inputs & s : in.sequences) {
        parts.push_back({s.first, s.n_tokens, &s.kv, &s.recurrent, &s.st});
    }
    return parts;
}

ggml_tensor * token_range(ggml_context * ctx, ggml_tensor * x, int dim, int64_t first, int64_t n) {
    if (first == 0 && n == x->ne[dim]) {
        return x;
    }
    GGML_ASSERT(dim >= 1 && dim <= 2 && first + n <= x->ne[dim]);
    if (dim == 1) {
        return ggml_view_3d(ctx, x, x->ne[0], n, x->ne[2], x->nb[1], x->nb[2], first * x->nb[1]);
    }
    return ggml_view_4d(ctx, x, x->ne[0], x->ne[1], n, x->ne[3], x->nb[1], x->nb[2], x->nb[3], first * x->nb[2]);
}

// whether parts are contiguous F32 tensors of one shape that end at dimension dim (stackable as sequences; ggml's
// set takes its offset as an int32)
static bool stackable(const std::vector<ggml_tensor *> & parts, int dim) {
    if (ggml_nbytes(parts[0]) * parts.size() > (size_t) INT32_MAX) {
        return false;
    }
    for (const ggml_tensor * p : parts) {
        if (p->type != GGML_TYPE_F32 || !ggml_is_contiguous(p) || !ggml_are_same_shape(p, parts[0])) {
            return false;
        }
        for (int d = dim + 1; d < GGML_MAX_DIMS; ++d) {
            if (p->ne[d] != 1) {
                return false;
            }
        }
    }
    return true;
}

ggml_tensor * join_tokens(ggml_context * ctx, const std::vector<ggml_tensor *> & parts, int dim) {
    GGML_ASSERT(!parts.empty());
    if (parts.size() > 1 && stackable(parts, dim)) {  // [.., n] each -> [.., n, N] -> [.., n*N]
        std::vector<ggml_tensor *> rows;
        for (ggml_tensor * p : parts) {
            rows.push_back(ggml_reshape_2d(ctx, p, ggml_nelements(p) / p->ne[dim], p->ne[dim]));
        }
        int64_t ne[GGML_MAX_DIMS] = {parts[0]->ne[0], parts[0]->ne[1], parts[0]->ne[2], parts[0]->ne[3]};
        ne[dim] *= (int64_t) parts.size();
        return ggml_reshape_4d(ctx, stack_sequences(ctx, rows), ne[0], ne[1], ne[2], ne[3]);
    }
    // pairwise, so that each row is copied log2(parts) times rather than up to parts times
    std::vector<ggml_tensor *> level = parts;
    while (level.size() > 1) {
        std::vector<ggml_tensor *> next;
        for (size_t i = 0; i + 1 < level.size(); i += 2) {
            next.push_back(ggml_concat(ctx, level[i], level[i + 1], dim));
        }
        if (level.size() % 2) {
            next.push_back(level.back());
        }
        level = std::move(next);
    }
    return level[0];
}

ggml_tensor * stack_sequences(ggml_context * ctx, const std::vector<ggml_tensor *> & parts) {
    GGML_ASSERT(!parts.empty());
    const ggml_tensor * first = parts[0];
    for (const ggml_tensor * p : parts) {
        GGML_ASSERT(p->type == GGML_TYPE_F32 && ggml_is_contiguous(p) && p->ne[2] == 1 && p->ne[3] == 1 &&
                    p->ne[0] == first->ne[0] && p->ne[1] == first->ne[1]);
    }
    const int64_t N     = (int64_t) parts.size();
    GGML_ASSERT(ggml_nbytes(first) * parts.size() <= (size_t) INT32_MAX);  // (ggml_set's offset is an int32)
    ggml_tensor * stack = ggml_repeat_4d(ctx, parts[0], first->ne[0], first->ne[1], N, 1);  // [a, b, N]
    for (int64_t i = 1; i < N; ++i) {
        stack = ggml_set_inplace(ctx, stack, parts[i], stack->nb[1], stack->nb[2], stack->nb[3], i * stack->nb[2]);
    }
    return stack;
}

}  // namespace pdf
