#include "state/feature_ring.h"
#include "core/error.h"
#include "core/graph_cache.h"

#include <algorithm>
#include <atomic>

namespace pdf {

feature_ring::feature_ring(const backends & devices, int il, int n_capture, int64_t n_embd, int capacity)
    : buffers_(1), capacity_(capacity), n_embd_(n_embd) {
    static std::atomic<uint64_t> next_id{1};
    id_ = next_id++;
    if (capacity <= 0 || n_capture <= 0) {
        throw std::invalid_argument(format("feature ring: capacity %d and %d capture layers must be positive",
                                           capacity, n_capture));
    }
    rows_ = buffers_.add(GGML_TYPE_F32, n_capture * n_embd, capacity, "feature_ring", devices.state_buft(il));
    if (buffers_.allocate()) {
        throw backend_error(format("could not allocate the target-feature ring (%.1f MiB)",
                                   ggml_nbytes(rows_) / 1048576.0));
    }
}

feature_ring::~feature_ring() = default;

ggml_tensor * feature_ring::layer_view(ggml_context * ctx, int c) const {
    return ggml_view_2d(ctx, rows_, n_embd_, capacity_, rows_->nb[1], (size_t) c * n_embd_ * sizeof(float));
}

ggml_tensor * feature_ring::add_writes(ggml_context * ctx, ggml_cgraph * gf,
                                       const std::vector<ggml_tensor *> & captured, int n_tokens) const {
    ggml_tensor * ring_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    ggml_set_input(ring_rows);
    for (size_t c = 0; c < captured.size(); ++c) {
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, layer_view(ctx, (int) c), captured[c], ring_rows));
    }
    return ring_rows;
}

void feature_ring::set_inputs(ggml_tensor * ring_rows, int n_past, int n) const {
    std::vector<int64_t> rows(n);
    for (int s = 0; s < n; ++s) {
        rows[s] = slot(n_past + s);
    }
    set_graph_input(ring_rows, rows.data(), 0, sizeof(int64_t) * n);
}

bool feature_ring::overwrites(int first, int n, const std::vector<int32_t> & rows) const {
    for (int32_t r : rows) {
        if (n >= capacity_ || (r - slot(first) + capacity_) % capacity_ < n) {
            return true;
        }
    }
    return false;
}

size_t feature_ring::n_bytes() const {
    return memory().total();
}

device_bytes feature_ring::memory() const {
    return buffers_.memory();
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

void ring_set::add(feature_ring * ring) {
    if (ring) {
        if (n_ == MAX_RINGS) {
            throw std::logic_error("ring_set: more than two feature rings");
        }
        rings_[n_++] = ring;
    }
}

int64_t ring_set::row_width() const {
    int64_t w = 0;
    for (int i = 0; i < n_; ++i) {
        w += rings_[i]->row_width();
    }
    return w;
}

int ring_set::capacity() const {
    int c = 0;
    for (int i = 0; i < n_; ++i) {
        c = i == 0 ? rings_[i]->capacity() : std::min(c, rings_[i]->capacity());
    }
    return c;
}

std::array<uint64_t, ring_set::MAX_RINGS> ring_set::ids() const {
    std::array<uint64_t, MAX_RINGS> ids{};
    for (int i = 0; i < n_; ++i) {
        ids[i] = rings_[i]->id();
    }
    return ids;
}

ring_set::writes ring_set::add_writes(ggml_context * ctx, ggml_cgraph * gf, const std::vector<ggml_tensor *> & captured,
                                      int n_tokens) const {
    writes w;
    size_t first = 0;
    for (int i = 0; i < n_; ++i) {
        const size_t n = rings_[i]->n_capture();
        if (first + n > captured.size()) {
            throw std::logic_error(format("ring_set: %zu captured layers do not fill the rings' columns",
                                          captured.size()));
        }
        w.rows[i] = rings_[i]->add_writes(ctx, gf, {captured.begin() + first, captured.begin() + first + n}, n_tokens);
        first += n;
    }
    return w;
}

void ring_set::set_inputs(const writes & w, int n_past, int n) const {
    for (int i = 0; i < n_; ++i) {
        rings_[i]->set_inputs(w.rows[i], n_past, n);
    }
}

}  // namespace pdf
