#include "models/sequences.h"

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

ggml_tensor * join_tokens(ggml_context * ctx, const std::vector<ggml_tensor *> & parts, int dim) {
    GGML_ASSERT(!parts.empty());
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

}  // namespace pdf
