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

// x: [E, B] (the block's rows in order); dyn: [2*K*groups, B] = proj(the sublayer's input); side 0 or 1 -> [E, B]
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

// The greedy path through one block on the host: per position t, scores_t(j) = unary[t][j] + lattice[t][i][j]
// with i the path's previous candidate (the anchor's row at t = 0); writes, per position, the k candidates
// ordered by score (ids and their log-softmax over the k: the selector's probabilities at temperature 1), the
// path's token first. unary: [P, k] (log-probabilities or logits: a constant per position changes nothing);
// lattice as build_dflash2_lattice's, read back.
void select_dflash2_path(const int32_t * cand, const float * unary, const float * lattice, int64_t P, int64_t k,
                         int32_t * out_ids, float * out_logprobs);

}  // namespace pdf
