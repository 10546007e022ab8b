// One graph of the target's own MTP head (state/mtp_session.h) over several target sessions' heads (continuous
// batching, state/eval_batcher.h): each session's step of a round, step 0 (its queued rows and the anchor, states
// from its trunk-state ring) or a later one (its last greedy draft on its carried state), goes through the head's
// weights and the output head together with the others', one matmul per weight for all of them, while each
// session's attention runs over its own K/V cache (eval_inputs::sequences) and each carries its own state on.
// Each session's candidates come out as its own begin() / next() would give them.
//
//   mtp_batch batch(target);
//   batch.draft({{&a, true, anchor_a, start_a, row_a}, {&b, true, anchor_b, start_b, row_b}});  // step 0
//   batch.draft({{&a, false}, {&b, false}});                                                   // step 1
//   a.proposals() ...   // as after a.begin(anchor_a, start_a, row_a); a.next()
#pragma once

#include "core/graph_cache.h"
#include "state/mtp_session.h"

#include <memory>
#include <vector>

namespace pdf {

class mtp_batch {
  public:
    // computes with backends and a compute buffer of its own (the model's CPU threads, core/backend.h)
    explicit mtp_batch(std::shared_ptr<const target_model> target);
    ~mtp_batch();
    mtp_batch(const mtp_batch &)             = delete;
    mtp_batch & operator=(const mtp_batch &) = delete;

    // one session's step: first, mtp_session::begin(anchor, start, h_row); else its next()
    struct part {
        mtp_session * h      = nullptr;
        bool          first  = true;
        int32_t       anchor = 0;
        int           start  = 0;
        int           h_row  = 0;
    };
    // whether these parts can share one graph: two or more distinct heads of this batch's target, all at step 0
    // or all past it, with one block size and one readout (candidates per position, log-probabilities)
    bool batches(const std::vector<part> & parts) const;
    // runs every part's step in one graph (batches(parts) must hold), in any order (one graph for any order of
    // the same sessions); each head's proposals are then its own, as after its begin() or next(). A typed error
    // (as theirs) leaves the heads to step alone.
    void draft(const std::vector<part> & parts);
    // Compute buffer bytes of one graph over these heads of this batch's target (ggml's allocator, nothing
    // allocated; memory plans), each at step 0 (first) or a later step, attending over n_kv of its cache slots. A
    // head may stand for several of its shape.
    size_t measure(const std::vector<mtp_session *> & heads, bool first, int n_kv);
    // the compute buffer its graphs share, as allocated so far
    device_bytes compute_memory() const { return arena_.memory(); }

  private:
    struct compiled;
    struct key_entry {
        uint64_t id;
        int      n_kv;
        bool     first;
        bool     operator==(const key_entry & o) const { return id == o.id && n_kv == o.n_kv && first == o.first; }
    };
    compiled & graph_for(const std::vector<part> & parts, const std::vector<mtp_session::step_rows> & rows);
    void       build(compiled & g, const std::vector<mtp_session *> & heads, bool first, const std::vector<int> & n_kv);
    void       set_inputs(compiled & g, const std::vector<mtp_session::step_rows> & rows);

    std::shared_ptr<const target_model>    target_;
    std::shared_ptr<compute_backends>      compute_;
    graph_arena                            arena_;
    std::vector<std::unique_ptr<compiled>> graphs_;
    uint64_t                               uses_ = 0;
};

}  // namespace pdf
