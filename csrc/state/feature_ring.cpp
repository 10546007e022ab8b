#include "state/feature_ring.h"
#include "core/error.h"

#include <atomic>

namespace pdf {

feature_ring::feature_ring(const backends & devices, int il, int n_capture, int64_t n_embd, int capacity)
    : capacity_(capacity), n_embd_(n_embd) {
    static std::atomic<uint64_t> next_id{1};
    id_ = next_id++;
    if (capacity <= 0 || n_capture <= 0) {
        throw std::invalid_argument(format("feature ring: capacity %d and %d capture layers must be positive",
                                           capacity, n_capture));
    }
    ggml_init_params params = {ggml_tensor_overhead() * 2, nullptr, true};
    ctx_                    = ggml_init(params);
    rows_                   = ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, n_capture * n_embd, capacity);
    ggml_set_name(rows_, "feature_ring");
    buf_ = alloc_tensors(devices.state_buft(il), {rows_});
    if (!buf_) {
        ggml_free(ctx_);
        throw backend_error(format("could not allocate the target-feature ring (%.1f MiB)",
                                   ggml_nbytes(rows_) / 1048576.0));
    }
}

feature_ring::~feature_ring() {
    if (buf_) {
        ggml_backend_buffer_free(buf_);
    }
    if (ctx_) {
        ggml_free(ctx_);
    }
}

ggml_tensor * feature_ring::layer_view(ggml_context * ctx, int c) const {
    return ggml_view_2d(ctx, rows_, n_embd_, capacity_, rows_->nb[1], (size_t) c * n_embd_ * sizeof(float));
}

size_t feature_ring::n_bytes() const {
    return memory().total();
}

device_bytes feature_ring::memory() const {
    return bytes_by_device({buf_});
}

void feature_ring::write(const float * feats, const int32_t * positions, int m) {
    const size_t row_bytes = rows_->nb[1];
    for (int i = 0; i < m; ++i) {
        if (positions[i] < 0) {
            throw std::out_of_range(format("feature ring: position %d is negative", positions[i]));
        }
    }
    for (int i = 0; i < m; ++i) {
        ggml_backend_tensor_set(rows_, feats + (size_t) i * row_width(), (size_t) slot(positions[i]) * row_bytes,
                                row_bytes);
    }
}

}  // namespace pdf
