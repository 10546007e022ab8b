// The rolling target-feature ring: the hidden states the target produced at the drafter's layers, for the
// tokens it has evaluated but the drafter has not yet turned into context K/V. The target's verify / prefill
// graph writes them here (set_rows, row = position % capacity) and the drafter's graph reads them (get_rows),
// so features never leave the device. Because the drafter projects each committed row once into its own
// KV cache, the ring only has to hold the rows of one target evaluation: capacity >= the prefill micro-batch
// and >= the block size.
#pragma once

#include "core/backend.h"
#include "state/state_buffers.h"

#include <array>
#include <cstdint>
#include <vector>

namespace pdf {

class feature_ring {
  public:
    // n_capture layers of n_embd floats per token; `il` picks the device (that layer's state buffer type)
    feature_ring(const backends & devices, int il, int n_capture, int64_t n_embd, int capacity);
    ~feature_ring();
    feature_ring(const feature_ring &)             = delete;
    feature_ring & operator=(const feature_ring &) = delete;

    ggml_tensor * rows() const { return rows_; }  // F32 [n_capture * n_embd, capacity]
    // the columns of capture layer c inside every row: F32 [n_embd, capacity] (strided view)
    ggml_tensor * layer_view(ggml_context * ctx, int c) const;
    int           capacity() const { return capacity_; }
    // unique for the process' lifetime (graphs that write into a ring are cached by it, not by its address)
    uint64_t      id() const { return id_; }
    int           slot(int64_t position) const { return (int) (position % capacity_); }
    int64_t       row_width() const { return rows_->ne[0]; }
    int           n_capture() const { return (int) (row_width() / n_embd_); }  // capture layers per row
    size_t        n_bytes() const;  // its buffer's, alignment included
    device_bytes  memory() const;

    // into graph gf: each batch token's captured[c] ([n_embd, n_tokens]) goes into its ring row, at capture
    // layer c's columns; returns the input naming those rows (I64 [n_tokens], set by set_inputs)
    ggml_tensor * add_writes(ggml_context * ctx, ggml_cgraph * gf, const std::vector<ggml_tensor *> & captured,
                             int n_tokens) const;
    // the rows of a batch of n tokens at positions n_past .. n_past+n-1
    void          set_inputs(ggml_tensor * ring_rows, int n_past, int n) const;
    // whether an evaluation writing positions [first, first + n) overwrites any of `rows`
    bool          overwrites(int first, int n, const std::vector<int32_t> & rows) const;

    // host path (tests, external features): rows [m, row_width] for the given positions
    void write(const float * feats, const int32_t * positions, int m);

  private:
    state_buffers         buffers_;
    ggml_tensor *         rows_ = nullptr;
    int                   capacity_;
    int64_t               n_embd_;
    uint64_t              id_;
};

// The rings one target evaluation writes its captured layers into, side by side in the list of capture layers:
// the first ring takes as many of them as its rows hold, the next the ones after those (a DFlash drafter's and the
// target's MTP head's, when both draft). Empty: the captures are read back to the host instead.
class ring_set {
  public:
    static constexpr int MAX_RINGS = 2;
    ring_set() = default;
    ring_set(feature_ring * ring) { add(ring); }  // (implicit: one ring or none)
    ring_set(feature_ring * first, feature_ring * second) {
        add(first);
        add(second);
    }

    ring_set & operator+=(const ring_set & more) {  // more's rings after these
        for (int i = 0; i < more.n_; ++i) {
            add(more.rings_[i]);
        }
        return *this;
    }

    bool    empty() const { return n_ == 0; }
    int64_t row_width() const;  // the rings' columns together
    int     capacity() const;   // the smallest ring's rows
    // the rings' ids (0: none), which name the graphs that write into them
    std::array<uint64_t, MAX_RINGS> ids() const;

    // the row inputs of each ring a graph writes (nullptr past the last)
    struct writes {
        std::array<ggml_tensor *, MAX_RINGS> rows{};
        bool any() const { return rows[0] != nullptr; }
    };
    // feature_ring::add_writes of each ring, with its share of `captured`
    writes add_writes(ggml_context * ctx, ggml_cgraph * gf, const std::vector<ggml_tensor *> & captured,
                      int n_tokens) const;
    // feature_ring::set_inputs of each ring
    void   set_inputs(const writes & w, int n_past, int n) const;

  private:
    void add(feature_ring * ring);
    std::array<feature_ring *, MAX_RINGS> rings_{};
    int                                   n_ = 0;
};

}  // namespace pdf
