// One drafter graph over several draft sessions of one drafter (continuous batching, state/eval_batcher.h): every
// session's queued context rows and block go through the drafter's weights together, one matmul per weight for
// all of them, while each session's context K/V cache, block attention and DFlash2 convolutions stay its own
// (models/dflash.h, draft_inputs::sequences); the head reads every block's proposals at once. Each session's
// proposals come out as its own draft() would give them.
//
//   draft_batch batch(drafter);
//   batch.draft({{&a, anchor_a, start_a}, {&b, anchor_b, start_b}});
//   a.proposals() ...   // as after a.draft(anchor_a, start_a)
#pragma once

#include "core/graph_cache.h"
#include "state/draft_session.h"

#include <memory>
#include <vector>

namespace pdf {

class draft_batch {
  public:
    // computes with backends and a compute buffer of its own (the model's CPU threads, core/backend.h)
    explicit draft_batch(std::shared_ptr<const dflash_draft> draft);
    ~draft_batch();
    draft_batch(const draft_batch &)             = delete;
    draft_batch & operator=(const draft_batch &) = delete;

    // one session's draft: what draft_session::draft takes (n_block 0: its block)
    struct part {
        draft_session * d       = nullptr;
        int32_t         anchor  = 0;
        int             start   = 0;
        int             n_block = 0;
    };
    // whether these parts can share one graph: two or more distinct sessions of this batch's drafter, drafting
    // blocks of one length, with one block size and one readout (candidates per position, log-probabilities)
    bool batches(const std::vector<part> & parts) const;
    // the block a part drafts
    static int block_of(const part & p);
    // drafts every part in one graph (batches(parts) must hold), in any order (one graph for any order of the
    // same sessions); each session's proposals are then its own, as after its draft(). A typed error (as
    // draft()'s) leaves the sessions to draft alone.
    void draft(const std::vector<part> & parts);
    // Compute buffer bytes of one graph over these sessions of this batch's drafter (ggml's allocator, nothing
    // allocated; for memory plans), each appending n_rows context rows and drafting n_block positions over n_kv
    // of its cache slots. A session may stand for several of its shape.
    size_t measure(const std::vector<draft_session *> & sessions, int n_rows, int n_block, int n_kv);
    // the compute buffer its graphs share, as allocated so far
    device_bytes compute_memory() const { return arena_.memory(); }

  private:
    struct compiled;
    struct key_entry {
        uint64_t id;
        int      n_rows, n_block, n_kv;
        bool     operator==(const key_entry & o) const {
            return id == o.id && n_rows == o.n_rows && n_block == o.n_block && n_kv == o.n_kv;
        }
    };
    compiled & graph_for(const std::vector<part> & parts, const std::vector<draft_session::call> & calls);
    void       build(compiled & g, const std::vector<part> & parts, const std::vector<draft_session::call> & calls);
    // each part's inputs (its own tensors, its rows of the shared ones) and where its proposals are
    void       add_parts(ggml_context * ctx, compiled & g, const std::vector<part> & parts,
                         const std::vector<draft_session::call> & calls);

    std::shared_ptr<const dflash_draft>    draft_;
    std::shared_ptr<compute_backends>      compute_;
    graph_arena                            arena_;
    std::vector<std::unique_ptr<compiled>> graphs_;
    uint64_t                               uses_ = 0;
};

}  // namespace pdf
