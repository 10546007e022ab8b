// ggml's own quantizers, for pydflash-quantize and the converter.
#pragma once

#include "ggml.h"

#include <cstddef>
#include <cstdint>

namespace pdf {

// bytes of one quantized row; throws std::invalid_argument when `type` cannot hold rows of n_per_row
size_t quantized_row_size(ggml_type type, int64_t n_per_row);
// quantize n_rows rows of n_per_row floats into dst (n_rows * quantized_row_size bytes)
void   quantize_rows(ggml_type type, const float * src, void * dst, int64_t n_rows, int64_t n_per_row);

}  // namespace pdf
