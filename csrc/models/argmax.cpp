// Greedy pick over the vocabulary on the CPU.
//
// ggml's CPU argmax runs on one thread, one dependent compare per element: over Qwen3.5's 248K-entry
// vocabulary that is ~0.3 ms per row, ~9% of a small model's decode step while the other threads wait at the
// next barrier, and 16 rows per DFlash verify. So when the logits are in host memory the search is two
// custom ops instead:
//   1. every thread takes (row, chunk) items in turn and finds each chunk's first maximum, vectorised
//      (~6x faster than ggml's loop on one thread);
//   2. one thread picks, per row, the chunk whose maximum is highest (the lower chunk on a tie).
// Ties go to the lowest index, as in torch/numpy argmax and llama.cpp's greedy sampler (ggml_argmax keeps the
// last). On another device the head's logits stay there and its own ggml_argmax runs.
#include "models/argmax.h"

#include "core/error.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace pdf {

static constexpr int64_t CHUNK = 8192;  // elements per work item: 32 KiB, one L1-sized read
static constexpr int     LANES = 32;    // independent running maxima: 8 SSE / 4 AVX registers

// first index of the maximum of x[0..n); NaN never compares greater, so it is skipped; 0 if all are NaN.
// Two passes over an L1-resident chunk, both vectorised (`omp simd`, -fopenmp-simd: no OpenMP runtime):
// the maximum, then the first block of LANES that holds it.
static int64_t chunk_first_max(const float * x, int64_t n) {
    float best[LANES];
    for (int j = 0; j < LANES; ++j) {
        best[j] = -std::numeric_limits<float>::infinity();
    }
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; ++j) {
            best[j] = x[i + j] > best[j] ? x[i + j] : best[j];
        }
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < LANES; ++j) {
        m = best[j] > m ? best[j] : m;
    }
    for (; i < n; ++i) {
        m = x[i] > m ? x[i] : m;
    }
    int64_t b = 0;
    for (; b + LANES <= n; b += LANES) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int j = 0; j < LANES; ++j) {
            hit |= x[b + j] == m;
        }
        if (hit) {
            break;
        }
    }
    for (; b < n; ++b) {
        if (x[b] == m) {
            return b;
        }
    }
    return 0;
}

// dst: I32 [n_chunks, n_rows] of row-global indices; src[0]: F32 logits [V, n_rows]
static void argmax_chunks(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * logits   = dst->src[0];
    const int64_t       V        = logits->ne[0];
    const int64_t       n_chunks = dst->ne[0];
    const int64_t       n_items  = n_chunks * dst->ne[1];
    for (int64_t item = ith; item < n_items; item += nth) {
        const int64_t row = item / n_chunks, c = item % n_chunks;
        const int64_t begin = c * CHUNK, n = std::min(CHUNK, V - begin);
        const float * x     = (const float *) ((const char *) logits->data + row * logits->nb[1]) + begin;
        ((int32_t *) ((char *) dst->data + row * dst->nb[1]))[c] = (int32_t) (begin + chunk_first_max(x, n));
    }
}

// dst: I32 [n_rows]; src[0]: the chunk winners [n_chunks, n_rows], src[1]: F32 logits [V, n_rows]
static void argmax_reduce(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * part   = dst->src[0];
    const ggml_tensor * logits = dst->src[1];
    for (int64_t row = ith; row < dst->ne[0]; row += nth) {
        const int32_t * cand = (const int32_t *) ((const char *) part->data + row * part->nb[1]);
        const float *   x    = (const float *) ((const char *) logits->data + row * logits->nb[1]);
        int32_t         best = cand[0];
        for (int64_t c = 1; c < part->ne[0]; ++c) {
            if (x[cand[c]] > x[best] || std::isnan(x[best])) {  // an all-NaN chunk's pick gives way
                best = cand[c];
            }
        }
        ((int32_t *) dst->data)[row] = best;
    }
}

ggml_tensor * build_argmax_rows(ggml_context * ctx, ggml_tensor * logits, bool logits_on_host) {
    if (!logits_on_host) {
        return ggml_argmax(ctx, logits);
    }
    GGML_ASSERT(logits->type == GGML_TYPE_F32 && ggml_is_contiguous_rows(logits) && ggml_is_matrix(logits));
    const int64_t V = logits->ne[0], n_rows = logits->ne[1];
    const int64_t n_chunks = (V + CHUNK - 1) / CHUNK;
    ggml_tensor * args[2]  = {logits, nullptr};
    ggml_tensor * part = ggml_custom_4d(ctx, GGML_TYPE_I32, n_chunks, n_rows, 1, 1, args, 1, argmax_chunks,
                                        GGML_N_TASKS_MAX, nullptr);
    args[0] = part;
    args[1] = logits;
    return ggml_custom_4d(ctx, GGML_TYPE_I32, n_rows, 1, 1, 1, args, 2, argmax_reduce, 1, nullptr);
}

std::vector<int32_t> argmax_rows_on_cpu(const float * data, int64_t n_rows, int64_t n_cols, int n_threads,
                                        bool stock) {
    if (n_rows < 1 || n_cols < 1 || n_cols > std::numeric_limits<int32_t>::max()) {
        throw error(format("argmax: need 1 <= rows and 1 <= columns < 2^31, got %lld x %lld", (long long) n_rows,
                           (long long) n_cols));
    }
    const size_t     data_bytes = (size_t) (n_rows * n_cols) * sizeof(float);
    ggml_init_params params     = {data_bytes + 4 * (size_t) n_rows * (n_cols / CHUNK + 2) + 64 * 1024 +
                                       ggml_graph_overhead(),
                                   nullptr, false};
    ggml_context *   ctx        = ggml_init(params);
    if (!ctx) {
        throw error("argmax: could not allocate the test context");
    }
    ggml_tensor * logits = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_cols, n_rows);
    std::memcpy(logits->data, data, data_bytes);
    ggml_tensor * out = stock ? ggml_argmax(ctx, logits) : build_argmax_rows(ctx, logits, true);
    ggml_cgraph * gf  = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    const ggml_status st = ggml_graph_compute_with_ctx(ctx, gf, n_threads);
    std::vector<int32_t> result((const int32_t *) out->data, (const int32_t *) out->data + n_rows);
    ggml_free(ctx);
    if (st != GGML_STATUS_SUCCESS) {
        throw error(format("argmax: graph compute failed (status %d)", (int) st));
    }
    return result;
}

}  // namespace pdf
