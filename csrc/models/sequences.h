// The sessions whose rows share one evaluation (model.h, eval_inputs::sequences; state/session_batch.h). The
// weights see every row at once; what reads or writes a session's memory (attention over its KV cache, its conv
// window and gated-delta-net state) runs on that session's rows alone, the same ops as in an evaluation of its own,
// so each session's rows come out as they would alone.
#pragma once

#include "models/model.h"

#include <vector>

namespace pdf {

// one session's rows of a batch and its memory
struct sequence_part {
    int64_t                  first = 0;  // its first row
    int64_t                  n     = 0;  // its rows
    const kv_inputs *        kv        = nullptr;
    const recurrent_inputs * recurrent = nullptr;
    const state_tensors *    st        = nullptr;
};

// the sessions of an evaluation: in.sequences, or the one session of in (its kv and recurrent inputs, memory st)
std::vector<sequence_part> sequence_parts(const eval_inputs & in, const state_tensors & st);

// x's rows [first, first + n) along dimension dim (the token dimension: 1 of [d0, n], 2 of [d0, d1, n]), a view
ggml_tensor * token_range(ggml_context * ctx, ggml_tensor * x, int dim, int64_t first, int64_t n);

// parts joined along dimension dim, in order (one part: itself)
ggml_tensor * join_tokens(ggml_context * ctx, const std::vector<ggml_tensor *> & parts, int dim);

// N contiguous F32 parts of one shape [a, b] (or [a, b, 1]; under 2 GiB in all), one per sequence, stacked as
// [a, b, N]: part i at index i of the last dimension. The first is repeated into every place, the others are
// set over it: row copies, where ggml's CPU concat moves element by element on one thread (along dimensions 0
// and 1).
ggml_tensor * stack_sequences(ggml_context * ctx, const std::vector<ggml_tensor *> & parts);

}  // namespace pdf
