// The drafter's mutable side: its context K/V cache (slot = token position) and its graph. Context rows are
// projected once per committed token; each round is ONE graph that appends the previous round's rows and
// drafts the next block, with fixed shapes, so it is built once and re-used.
#pragma once

#include "models/dflash.h"
#include "state/kv_cache.h"

#include <memory>
#include <vector>

namespace pdf {

class draft_session {
  public:
    draft_session(std::shared_ptr<const dflash_draft> draft, uint32_t n_ctx, int block);
    ~draft_session();
    draft_session(const draft_session &)             = delete;
    draft_session & operator=(const draft_session &) = delete;

    // feats: [m, n_ext*E] row-major (captured layers concatenated per token), at the given positions
    void append(const float * feats, const int32_t * positions, int m);
    // append m rows (m <= block), then draft the block [anchor, MASK x (block-1)] at start..; returns the
    // argmax of slots 1..block-1 (the proposals for positions start+1 ..)
    const std::vector<int32_t> & draft(const float * feats, const int32_t * positions, int m, int32_t anchor,
                                       int start);

    // context rows exist for positions [0, n_valid): the target's reused prefix must not go beyond it
    int                  n_valid() const { return n_valid_; }
    const dflash_draft & model() const { return *draft_; }
    int                  block() const { return block_; }
    size_t               kv_bytes() const { return kv_->n_bytes(); }

  private:
    void run(const float * feats, const int32_t * positions, int m, int n_rows, int n_block, int32_t anchor,
             int start);

    std::shared_ptr<const dflash_draft> draft_;
    std::unique_ptr<kv_cache>           kv_;
    ggml_backend_sched_t                sched_ = nullptr;
    int                                 block_;
    int                                 n_valid_ = 0;
    int64_t                             row_width_;

    int                  key_rows_ = -1, key_block_ = -1, key_kv_ = -1;
    ggml_context *       graph_ctx_ = nullptr;
    ggml_cgraph *        gf_        = nullptr;
    draft_inputs         in_;
    ggml_tensor *        out_ = nullptr;
    std::vector<uint8_t> graph_buf_;
    std::vector<int32_t> proposals_;
};

}  // namespace pdf
