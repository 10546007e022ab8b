// DFlash2's convolution and selector (see dflash2.h). Legend: E = n_embd, B = block rows, K = taps, G = groups
// (E / group), P = proposal rows (B - 1), k = selector candidates per row.
#include "models/dflash2.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace pdf {

dflash2_hparams read_dflash2_hparams(const gguf_file & f, int64_t n_embd) {
    static const char * keys[] = {"dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank",
                                  "dflash.selector_top_k"};
    int present = 0;
    for (const char * k : keys) {
        present += f.has_key(k);
    }
    dflash2_hparams hp;
    if (present == 0) {
        return hp;
    }
    for (const char * k : keys) {
        if (!f.has_key(k)) {
            throw format_error(format("%s: a DFlash2 drafter needs all of dflash.conv_kernel_size, conv_group_size, "
                                      "selector_rank and selector_top_k; '%s' is missing", f.path().c_str(), k));
        }
    }
    hp.kernel = f.u32_in(keys[0], 1, 64);
    hp.group  = f.u32_in(keys[1], 1, (uint32_t) n_embd);
    hp.rank   = f.u32_in(keys[2], 1, 1u << 16);
    hp.top_k  = f.u32_in(keys[3], 1, 256);
    if (n_embd % hp.group != 0) {
        throw format_error(format("%s: dflash.conv_group_size = %lld does not divide the hidden size %lld",
                                  f.path().c_str(), (long long) hp.group, (long long) n_embd));
    }
    return hp;
}

ggml_tensor * build_dflash2_conv(ggml_context * ctx, ggml_tensor * x, ggml_tensor * dyn, const dflash2_conv & w,
                                 int side, const dflash2_hparams & hp) {
    const int64_t E = x->ne[0], B = x->ne[1], S = x->ne[2], K = hp.kernel, G = E / hp.group;
    const size_t  f = ggml_element_size(dyn);
    ggml_tensor * y = nullptr;
    for (int64_t o = 0; o < std::min(K, B); ++o) {
        // x_{t-o}: each block's rows shifted down by o, zeros above
        ggml_tensor * xo = o == 0 ? x
                                  : ggml_pad_ext(ctx, ggml_view_3d(ctx, x, E, B - o, S, x->nb[1], x->nb[2], 0), 0, 0,
                                                 o, 0, 0, 0, 0, 0);
        ggml_tensor * base = ggml_view_1d(ctx, w.base, E, (size_t) ((side * K + o) * E) * ggml_element_size(w.base));
        // dyn_t[side][o][g]: [1, G, B, S], one coefficient per group, broadcast over its channels
        ggml_tensor * d  = ggml_view_4d(ctx, dyn, 1, G, B, S, f, dyn->nb[1], dyn->nb[2],
                                        (size_t) ((side * K + o) * G) * f);
        ggml_tensor * xg = ggml_reshape_4d(ctx, ggml_is_contiguous(xo) ? xo : ggml_cont(ctx, xo), hp.group, G, B, S);
        ggml_tensor * term =
            ggml_add(ctx, ggml_mul(ctx, xo, base), ggml_reshape_3d(ctx, ggml_mul(ctx, xg, d), E, B, S));
        y = y ? ggml_add(ctx, y, term) : term;
    }
    return y;
}

ggml_tensor * build_dflash2_lattice(ggml_context * ctx, const dflash2_selector & s, ggml_tensor * hidden,
                                    ggml_tensor * cand, ggml_tensor * anchor) {
    const int64_t k = cand->ne[0], P = cand->ne[1], R = s.prev->ne[0];
    ggml_tensor * h    = ggml_mul_mat(ctx, s.hidden, hidden);  // [R, P]
    ggml_tensor * succ = ggml_reshape_3d(ctx, ggml_get_rows(ctx, s.next, ggml_reshape_1d(ctx, cand, k * P)), R, k, P);
    // the predecessors: the anchor (k times) for row 0, then row t-1's candidates for row t
    ggml_tensor * pred = ggml_repeat_4d(ctx, ggml_get_rows(ctx, s.prev, anchor), R, k, 1, 1);  // [R, k]
    if (P > 1) {
        ggml_tensor * rest = ggml_get_rows(ctx, s.prev, ggml_view_1d(ctx, cand, k * (P - 1), 0));  // [R, k*(P-1)]
        pred               = ggml_concat(ctx, ggml_reshape_2d(ctx, pred, R, k), rest, 1);
    }
    pred = ggml_mul(ctx, ggml_reshape_3d(ctx, pred, R, k, P), ggml_reshape_3d(ctx, h, R, 1, P));
    return ggml_mul_mat(ctx, succ, pred);  // [k (j), k (i), P]
}

// the k candidates (unsorted indices) best first by unary[j] + pair[j], and their log-softmax
static void rank_one(const float * unary, const float * pair, int64_t k, std::vector<int64_t> & order,
                     std::vector<double> & logp) {
    std::vector<double> score(k);
    for (int64_t j = 0; j < k; ++j) {
        score[j] = (double) unary[j] + (double) pair[j];
    }
    order.resize(k);
    std::iota(order.begin(), order.end(), 0);
    // ties: the earlier candidate (torch.argmax's first maximum)
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    double z = 0.0;
    for (int64_t j = 0; j < k; ++j) {
        z += std::exp(score[j] - score[order[0]]);
    }
    logp.resize(k);
    for (int64_t r = 0; r < k; ++r) {
        logp[r] = score[order[r]] - score[order[0]] - std::log(z);
    }
}

void rank_dflash2_candidates(const int32_t * cand, const float * unary, const float * lattice, int64_t P, int64_t k,
                             dflash2_ranking & out) {
    // the greedy path's order at each position: to_cand[t][r] = the unsorted index of rank r, to_rank its inverse
    std::vector<int64_t> to_cand((size_t) (P * k)), to_rank((size_t) (P * k)), order;
    std::vector<double>  logp;
    out.ids.resize((size_t) (P * k));
    out.logprobs.resize(out.ids.size());
    int64_t prev = 0;  // row 0: every predecessor row is the anchor's
    for (int64_t t = 0; t < P; ++t) {
        rank_one(unary + t * k, lattice + (t * k + prev) * k, k, order, logp);
        for (int64_t r = 0; r < k; ++r) {
            to_cand[t * k + r]        = order[r];
            to_rank[t * k + order[r]] = r;
            out.ids[t * k + r]        = cand[t * k + order[r]];
            out.logprobs[t * k + r]   = (float) logp[r];
        }
        prev = order[0];
    }
    // given each candidate of the position before
    out.child_rank.resize((size_t) (P * k * k));
    out.child_logprob.resize(out.child_rank.size());
    for (int64_t t = 0; t < P; ++t) {
        for (int64_t i = 0; i < k; ++i) {
            const int64_t pred = t == 0 ? 0 : to_cand[(t - 1) * k + i];
            rank_one(unary + t * k, lattice + (t * k + pred) * k, k, order, logp);
            for (int64_t r = 0; r < k; ++r) {
                out.child_rank[(t * k + i) * k + r]    = (int32_t) to_rank[t * k + order[r]];
                out.child_logprob[(t * k + i) * k + r] = (float) logp[r];
            }
        }
    }
}

}  // namespace pdf
