// The drafter's mutable side: the target-feature ring it reads, its context K/V cache and its graph.
// Context rows are projected once per committed token into the cache; the cache is a window of the last
// `window` positions (slot = position % (window + block)), so its memory does not grow with the
// conversation. Each round is ONE graph that appends the previous round's rows (read from the ring on the
// device) and drafts the next block, with fixed shapes, so it is built once and re-used.
#pragma once

#include "models/dflash.h"
#include "state/feature_ring.h"
#include "state/kv_cache.h"

#include <memory>
#include <vector>

namespace pdf {

struct draft_params {
    int block         = 0;     // tokens per round; 0 = the draft's trained block size
    int window        = 4096;  // context positions the drafter attends to (sliding); clamped to n_ctx
    int ring_capacity = 512;   // feature-ring rows; >= the target's prefill micro-batch and >= block
};

class draft_session {
  public:
    draft_session(std::shared_ptr<const dflash_draft> draft, uint32_t n_ctx, const draft_params & params);
    ~draft_session();
    draft_session(const draft_session &)             = delete;
    draft_session & operator=(const draft_session &) = delete;

    // the ring the target's evaluations write features into (session::eval(..., ring()))
    feature_ring & ring() { return *ring_; }

    // project the ring rows of m committed tokens (position order) into the context cache
    void append(const int32_t * positions, int m);
    // append m ring rows (m <= block), then draft the block [anchor, MASK x (n_block-1)] at start..; returns
    // the argmax of slots 1..n_block-1 (the proposals for positions start+1 ..). n_block 0 = block(); a
    // shorter block is how the last round of a generation drafts only what max_tokens leaves room for.
    const std::vector<int32_t> & draft(const int32_t * positions, int m, int32_t anchor, int start, int n_block = 0);
    // forget context rows at positions >= n_past (the target cut its cache back)
    void truncate(int n_past);

    // context rows exist for the window before n_valid: the target's reused prefix must not go beyond it
    int                  n_valid() const { return n_valid_; }
    const dflash_draft & model() const { return *draft_; }
    int                  block() const { return block_; }
    int                  window() const { return window_; }
    size_t               kv_bytes() const { return kv_->n_bytes(); }

  private:
    void run(const int32_t * positions, int m, int n_rows, int n_block, int32_t anchor, int start);
    int  slot(int64_t position) const { return (int) (position % n_slots_); }

    std::shared_ptr<const dflash_draft> draft_;
    std::unique_ptr<feature_ring>       ring_;
    std::unique_ptr<kv_cache>           kv_;
    ggml_backend_sched_t                sched_ = nullptr;
    int                                 block_;
    int                                 window_;
    int                                 n_slots_;   // window + block
    int                                 n_valid_ = 0;
    std::vector<int32_t>                slot_pos_;  // position held by each cache slot (-1: none)

    int                  key_rows_ = -1, key_block_ = -1, key_kv_ = -1;
    ggml_context *       graph_ctx_  = nullptr;
    ggml_cgraph *        gf_         = nullptr;
    ggml_tensor *        ring_rows_  = nullptr;  // I32 [n_rows]: ring rows of the appended context
    draft_inputs         in_;
    ggml_tensor *        out_ = nullptr;
    std::vector<uint8_t> graph_buf_;
    std::vector<int32_t> proposals_;
};

}  // namespace pdf
