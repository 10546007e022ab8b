// Greedy pick: the index of the highest logit in each row of the output head.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <vector>

namespace pdf {

// logits: F32 [V, n_rows] -> I32 [n_rows], the first index of each row's maximum (NaN entries skipped).
// logits_on_host: the head runs on the CPU backend. Then all CPU threads share the search (see argmax.cpp);
// otherwise the stock ggml_argmax runs on the head's device.
ggml_tensor * build_argmax_rows(ggml_context * ctx, ggml_tensor * logits, bool logits_on_host);

// For the kernel test: one graph over `data` ([n_rows][n_cols]) on the CPU with n_threads, the threaded
// kernel (stock = false) or ggml_argmax (stock = true).
std::vector<int32_t> argmax_rows_on_cpu(const float * data, int64_t n_rows, int64_t n_cols, int n_threads,
                                        bool stock);

}  // namespace pdf
