#include "core/quantize.h"
#include "core/error.h"

#include <stdexcept>

namespace pdf {

size_t quantized_row_size(ggml_type type, int64_t n_per_row) {
    if ((int) type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(type) == 0) {
        throw std::invalid_argument(format("quantize: %d is not a ggml type", (int) type));
    }
    if (n_per_row < 1) {
        throw std::invalid_argument(format("quantize: rows of %lld values: expected at least 1",
                                           (long long) n_per_row));
    }
    if (n_per_row % ggml_blck_size(type) != 0) {
        throw std::invalid_argument(format("quantize: rows of %lld values cannot be stored as %s (block size %lld)",
                                           (long long) n_per_row, ggml_type_name(type),
                                           (long long) ggml_blck_size(type)));
    }
    return ggml_row_size(type, n_per_row);
}

// the types ggml_quantize_chunk writes (others abort in it): the float types and the quantized ones with a
// quantizer (not Q8_1 / Q8_K, which only hold matmul activations)
static bool is_quantizable(ggml_type type) {
    if (type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16) {
        return true;
    }
    return ggml_is_quantized(type) && type != GGML_TYPE_Q8_1 && type != GGML_TYPE_Q8_K;
}

void quantize_rows(ggml_type type, const float * src, void * dst, int64_t n_rows, int64_t n_per_row) {
    quantized_row_size(type, n_per_row);
    if (!is_quantizable(type)) {
        throw std::invalid_argument(format("quantize: %s is not a type weights can be quantized to", ggml_type_name(type)));
    }
    if (ggml_quantize_requires_imatrix(type)) {
        throw std::invalid_argument(format("quantize: %s needs an importance matrix, which pydflash does not compute",
                                           ggml_type_name(type)));
    }
    ggml_quantize_init(type);
    ggml_quantize_chunk(type, src, dst, 0, n_rows, n_per_row, nullptr);
}

}  // namespace pdf
