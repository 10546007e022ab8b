// Gated delta net layers over several sessions' rows in one evaluation (models/sequences.h), when each session's
// rows are a chain of the same length whose state is written after its last token: decoding streams stepped
// together, chains of one length, prompt micro-batches of one size. One ssm_conv and one gated_delta_net run
// over all of them (a sequence each: the ops' n_seqs) in place of one of each per session; what is left per
// session is reading and writing its own memory. Per sequence the ops compute what they compute alone (their
// sequences are independent), so every session's rows come out as they would alone.
// Shapes: N sessions of n rows each, rows session after session; S, Hk, Hv, C as in models/delta_net.h.
#pragma once

#include "models/delta_net.h"
#include "models/sequences.h"

#include <vector>

namespace pdf {

// whether parts can run together here: two or more chains of one length, each writing the state after its last
// token (ssm_split_at 0), rows in part order
bool chains_of_one_length(const std::vector<sequence_part> & parts);

// x: [C, n*N] -> conv [C, n*N] (before the SiLU). Each session's window read from and its kept tail written to
// its own conv buffer.
ggml_tensor * build_conv_chains(ggml_context * ctx, ggml_cgraph * gf, const std::vector<sequence_part> & parts,
                                int il, ggml_tensor * x, ggml_tensor * kernel);

// q, k: [S, Hk, n*N], v: [S, Hv, n*N], g, beta: [1, Hv, n*N] -> [S, Hv, n*N]. Each session's state read from
// its ssm_row and written to its ssm_out_row; with keep_steps its tokens' inputs kept in its step rows.
ggml_tensor * build_gated_delta_net_chains(ggml_context * ctx, ggml_cgraph * gf,
                                           const std::vector<sequence_part> & parts, int il, ggml_tensor * q,
                                           ggml_tensor * k, ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta);

}  // namespace pdf
