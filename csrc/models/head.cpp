#include "models/head.h"
#include "models/argmax.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace pdf {

head_outputs build_head(ggml_context * ctx, ggml_tensor * head, ggml_tensor * hidden, bool logits_on_host,
                        int top_k, bool with_logprobs) {
    head_outputs out;
    const int64_t n = hidden->ne[1];
    out.logits      = ggml_mul_mat(ctx, head, hidden);  // [V, n]
    ggml_set_name(out.logits, "logits");
    out.argmax = build_argmax_rows(ctx, out.logits, logits_on_host);  // [n]
    if (top_k > 0) {
        const int64_t V = out.logits->ne[0];
        // k = 1 is the greedy pick itself, so a chain's proposals are exactly the argmax (same tie rule)
        out.top_ids = top_k == 1 ? ggml_reshape_2d(ctx, out.argmax, 1, n) : ggml_top_k(ctx, out.logits, top_k);
        if (!with_logprobs) {
            return out;
        }
        // probabilities of the picked entries: softmax over the row, gathered ([1, V, n] rows by [k, n] ids)
        ggml_tensor * probs = ggml_soft_max(ctx, out.logits);
        ggml_tensor * picked = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, V, n), out.top_ids);  // [1, k, n]
        out.top_logprobs = ggml_log(ctx, ggml_reshape_2d(ctx, picked, top_k, n));
    }
    return out;
}

void sort_top_k(int32_t * ids, float * logprobs, int64_t n_rows, int k) {
    std::vector<std::pair<float, int32_t>> row(k);
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int j = 0; j < k; ++j) {
            row[j] = {logprobs[r * k + j], ids[r * k + j]};
        }
        std::sort(row.begin(), row.end(), [](const auto & a, const auto & b) {
            return a.first != b.first ? a.first > b.first : a.second < b.second;
        });
        for (int j = 0; j < k; ++j) {
            logprobs[r * k + j] = row[j].first;
            ids[r * k + j]      = row[j].second;
        }
    }
}

head_outputs build_top_k_readout(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * head, ggml_tensor * hidden,
                                 bool logits_on_host, int top_k, bool with_logprobs) {
    const head_outputs out = build_head(ctx, head, hidden, logits_on_host, top_k, with_logprobs);
    for (ggml_tensor * t : {out.top_ids, out.top_logprobs}) {
        if (t) {
            ggml_set_output(t);
            ggml_build_forward_expand(gf, t);
        }
    }
    return out;
}

}  // namespace pdf
