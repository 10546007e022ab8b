// The output head, outside the architectures: a graph builder returns its final normed hidden states and the
// caller (target session, drafter) turns them into what it wants to read back this call.
#pragma once

#include "ggml.h"

#include <cstdint>

namespace pdf {

struct head_outputs {
    ggml_tensor * logits       = nullptr;  // F32 [V, n]
    ggml_tensor * argmax       = nullptr;  // I32 [n]: the greedy pick (first index of the maximum)
    ggml_tensor * top_ids      = nullptr;  // I32 [k, n]: the k most likely tokens per row, in no particular order
    ggml_tensor * top_logprobs = nullptr;  // F32 [k, n]: their log-probabilities (log-softmax of the logits)
};

// hidden: [E, n] (after the final norm); head: [E, V]. top_k > 0 adds the top-k readout (k = 1: the argmax),
// with their log-probabilities unless with_logprobs is false (top_logprobs then stays null: a softmax over the
// vocabulary saved). logits_on_host: the head runs on the CPU backend (the greedy pick then uses all threads).
head_outputs build_head(ggml_context * ctx, ggml_tensor * head, ggml_tensor * hidden, bool logits_on_host,
                        int top_k = 0, bool with_logprobs = true);

// build_head's top-k readout of hidden, marked as graph outputs in gf (what a drafter reads back each call)
head_outputs build_top_k_readout(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * head, ggml_tensor * hidden,
                                 bool logits_on_host, int top_k, bool with_logprobs);

// the rows of a top-k readout read back ([n_rows, k] each), each put most likely first (ties: the lower id), as
// ggml's top-k leaves them in no particular order
void sort_top_k(int32_t * ids, float * logprobs, int64_t n_rows, int k);

}  // namespace pdf
