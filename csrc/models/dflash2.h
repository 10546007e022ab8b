// DFlash2's additions to a DFlash drafter (models/dflash.h), as z-lab's DFlash2DraftModel defines them and
// llama.cpp stores them (GGUF keys dflash.conv_kernel_size, conv_group_size, selector_rank, selector_top_k):
// - around each draft layer's attention and MLP, a grouped dynamic causal convolution over the block's rows:
//     y_t = sum_{o < K} (base[side][o] + dyn_t[side][o][group(c)]) * x_{t-o}   (x before row 0: zeros)
//   where dyn_t = proj(sublayer input row t) holds both sides' K x groups coefficients; side 0 convolves the
//   sublayer's input, side 1 its output;
// - a candidate selector that reranks the top-k drafted tokens of each position by the token before them:
//     score_t(j | i) = unary_t(j) + <prev[i] * (W h_t), next[j]>
//   along the drafted path (greedy: the best j given the path's previous token i, the anchor first).
#pragma once

#include "core/gguf_file.h"
#include "ggml.h"

#include <cstdint>
#include <vector>

namespace pdf {

struct dflash2_hparams {
    int64_t kernel = 0;  // K: taps, the row itself and K-1 before it
    int64_t group  = 0;  // channels sharing one dynamic coefficient
    int64_t rank   = 0;  // the selector's codebook width
    int64_t top_k  = 0;  // candidates the selector reranks per position
    bool    present() const { return kernel > 0; }
};

// the four keys (all or none; typed errors naming the key and the expected range, or the hidden size they must
// divide), none when the file is a DFlash (v1) drafter
dflash2_hparams read_dflash2_hparams(const gguf_file & f, int64_t n_embd);

// one sublayer's convolution weights: base [E, K, 2], proj [E, 2*K*groups] (a matmul weight)
struct dflash2_conv {
    ggml_tensor * base = nullptr;
    ggml_tensor * proj = nullptr;
};

// x: [E, B] (the block's rows in order), or [E, B, S] (S sessions' blocks, each convolved on its own rows);
// dyn: [2*K*groups, B(, S)] = proj(the sublayer's input); side 0 or 1 -> x's shape
ggml_tensor * build_dflash2_conv(ggml_context * ctx, ggml_tensor * x, ggml_tensor * dyn, const dflash2_conv & w,
                                 int side, const dflash2_hparams & hp);

// the selector's weights: prev, next [rank, V] (rows looked up by token), hidden [E, rank] (a matmul weight)
struct dflash2_selector {
    ggml_tensor * prev   = nullptr;
    ggml_tensor * next   = nullptr;
    ggml_tensor * hidden = nullptr;
};

// hidden: [E, P] (the proposal rows' final hidden states), cand: I32 [k, P] (each row's top-k tokens, in the
// readout's order), anchor: I32 [1] -> F32 [k (candidate j), k (predecessor i), P]: the pairwise term of
// score_t(j | i), the predecessors of row 0 all the anchor, of row t the candidates of row t-1
ggml_tensor * build_dflash2_lattice(ggml_context * ctx, const dflash2_selector & s, ggml_tensor * hidden,
                                    ggml_tensor * cand, ggml_tensor * anchor);

// The selector's ranking of one block, on the host, from cand [P, k], unary [P, k] (log-probabilities or logits: a
// constant per position changes nothing) and lattice (build_dflash2_lattice's, read back). scores_t(j | i) =
// unary[t][j] + lattice[t][i][j]; probabilities are their softmax over the k (temperature 1).
//   ids, logprobs [P, k]: each position's candidates given the greedy path's previous token (the anchor at 0),
//     best first: rank 0 at every position is the drafted path (z-lab's propose);
//   child_rank, child_logprob [P, k, k]: given rank i (in that order) at t-1, the ranks at t best first and their
//     log-probabilities (t = 0: the same for every i, the anchor's).
struct dflash2_ranking {
    std::vector<int32_t> ids, child_rank;
    std::vector<float>   logprobs, child_logprob;
};
void rank_dflash2_candidates(const int32_t * cand, const float * unary, const float * lattice, int64_t P, int64_t k,
                             dflash2_ranking & out);

}  // namespace pdf
