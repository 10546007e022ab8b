// The drafter's mutable side: the target-feature ring it reads, its context K/V cache and its graph.
// Context rows are projected once per committed token into the cache; the cache is a window of the last
// `window` positions (slot = position % (window + block)), so its memory does not grow with the
// conversation. Committed tokens' ring rows are queued and appended lazily: a round's draft graph appends
// the previous round's rows and drafts the next block in ONE graph of fixed shape, built once and re-used;
// rows queued while no round drafts (plain decoding) are appended in larger graphs only when a draft needs
// them or a target evaluation would overwrite them in the ring.
#pragma once

#include "core/graph_cache.h"
#include "models/dflash.h"
#include "state/feature_ring.h"
#include "state/kv_cache.h"

#include <memory>
#include <vector>

namespace pdf {

// how a DFlash2 drafter's candidates rank in a tree (models/dflash2.h): each node's children by the selector given
// that node's token; every position's by the selector given the drafted path's token; or by the drafter's logits
// alone (DFlash's way; the path stays the selector's)
enum class selector_tree { per_node, path, unary };

struct draft_params {
    int block         = 0;     // tokens per round; 0 = the draft's trained block size
    int window        = 4096;  // context positions the drafter attends to (sliding); clamped to n_ctx
    int ring_capacity = 512;   // feature-ring rows; >= the target's prefill micro-batch and >= a verify's rows
    int  top_k         = 1;     // candidates per drafted position (1: the greedy chain)
    bool with_logprobs = true;  // their log-probabilities (trees and auto build on them; a chain does not)
    selector_tree dflash2_tree = selector_tree::per_node;
};

// one draft call: for each drafted position start+1 .. start+n_positions, the top_k candidates, most likely first
struct draft_proposals {
    int                  n_positions = 0;
    int                  top_k       = 0;
    std::vector<int32_t> ids;       // [n_positions, top_k]
    std::vector<float>   logprobs;  // [n_positions, top_k]: log-softmax of the drafter's logits (0 if not read)
    int32_t id(int pos, int rank) const { return ids[(size_t) pos * top_k + rank]; }
    float   logprob(int pos, int rank) const { return logprobs[(size_t) pos * top_k + rank]; }

    // DFlash2's selector (models/dflash2.h): a position's candidates ranked given which candidate of the position
    // before precedes them (ids / logprobs above are those given the drafted path's, rank 0). Empty otherwise.
    // child_rank / child_logprob [n_positions, all_k, top_k]: given rank i at pos-1 (pos 0: i = 0, the anchor),
    // the rank (in all_ids' order, < all_k) and log-probability of the r-th best candidate at pos.
    int                  all_k = 0;
    std::vector<int32_t> all_ids;  // [n_positions, all_k]: every candidate the selector ranked
    std::vector<int32_t> child_rank;
    std::vector<float>   child_logprob;
    bool    conditional() const { return !child_rank.empty(); }
    int32_t child(int pos, int parent_rank, int r) const {
        return child_rank[((size_t) pos * all_k + parent_rank) * top_k + r];
    }
    float child_lp(int pos, int parent_rank, int r) const {
        return child_logprob[((size_t) pos * all_k + parent_rank) * top_k + r];
    }
};

class draft_session {
  public:
    // compute: the backends of the target session it drafts for (one thread pool per conversation: two pools
    // taking turns spin against each other); nullptr: backends of its own
    draft_session(std::shared_ptr<const dflash_draft> draft, uint32_t n_ctx, const draft_params & params,
                  std::shared_ptr<compute_backends> compute = nullptr);
    ~draft_session();
    draft_session(const draft_session &)             = delete;
    draft_session & operator=(const draft_session &) = delete;

    // the ring the target's evaluations write features into (session::eval(..., ring()))
    feature_ring & ring() { return *ring_; }

    // queue m committed tokens' ring rows, at consecutive positions after the queued ones (appended later)
    void queue(const int32_t * ring_rows, const int32_t * positions, int m);
    // queue the ring rows of positions [first, first + m) (rows written at ring slot(position))
    void queue_positions(int first, int m);
    // positions [first, first + m) have no context rows: the target evaluated them without capturing (auto's
    // plain rounds far from its next draft, decode/proposer.h). Drafts attend around them (their slots are
    // masked), as a drafter given only the other positions would. first must be n_valid().
    void skip(int first, int m);
    // append everything queued to the context cache now
    void flush();
    // a target evaluation is about to write the ring rows of positions [first, first + n): flush first if that
    // would overwrite a queued row
    void protect(int first, int n);
    // draft the block [anchor, MASK x (n_block-1)] at start.. over the context (queued rows appended first,
    // in the same graph): the top_k candidates of positions start+1 .. start+n_block-1. n_block 0 = block(); a
    // shorter block is how the last round of a generation drafts only what max_tokens leaves room for.
    const draft_proposals & draft(int32_t anchor, int start, int n_block = 0);
    // forget context rows at positions >= n_past (the target cut its cache back), queued ones included
    void truncate(int n_past);

    // context rows exist (appended, queued or skipped) for the window before n_valid: the target's reused prefix
    // must not go beyond it
    int                  n_valid() const;
    const dflash_draft & model() const { return *draft_; }
    const std::shared_ptr<const dflash_draft> & shared_model() const { return draft_; }
    // the last draft's proposals (draft()'s, or a draft_batch's)
    const draft_proposals & proposals() const { return proposals_; }
    int                  block() const { return block_; }
    int                  window() const { return window_; }
    int                  top_k() const { return top_k_; }
    size_t               kv_bytes() const { return kv_->n_bytes(); }
    device_bytes         kv_memory() const { return kv_->memory(); }
    device_bytes         ring_memory() const { return ring_->memory(); }
    device_bytes         compute_memory() const { return arena_.memory(); }
    // compute buffer bytes of the graph that appends n_rows context rows (0, or one of append_row_counts()) and
    // drafts n_block positions over n_kv cache slots (ggml's allocator, nothing allocated; memory plans)
    size_t               measure(int n_rows, int n_block, int n_kv);
    static std::vector<int> append_row_counts();
    static int              window_step();  // its attended window grows in steps of this many slots
    int                     n_slots() const { return n_slots_; }  // window + block

  private:
    friend class draft_batch;  // drafts several sessions' blocks in one graph, through the steps below
    // one graph's work for this session: append m queued rows (padded to n_rows, from position pad_from), then
    // draft n_block (0: none) at start over n_kv cache slots
    struct call {
        int     m = 0, n_rows = 0, n_block = 0, n_kv = 0, pad_from = 0, start = 0;
        int32_t anchor = 0;
    };
    // where a call's inputs go in a graph: tensors of its own (ring rows, slots, masks), and rows of the graph's
    // shared ones (ctx_pos from ctx_first, tokens and pos from first)
    struct call_inputs {
        ggml_tensor * ring_rows = nullptr, * ctx_pos = nullptr, * ctx_slots = nullptr, * tokens = nullptr,
                    * pos = nullptr, * slots = nullptr, * kq_mask = nullptr, * kq_mask_swa = nullptr;
        int64_t       ctx_first = 0, first = 0;
    };
    // where its proposals are: the head's outputs (and DFlash2's lattice) from proposal row `first`
    struct call_outputs {
        ggml_tensor * top_ids = nullptr, * top_logprobs = nullptr, * lattice = nullptr;
        int64_t       first   = 0;
    };
    call shape(int m, int n_rows, int n_block, int32_t anchor, int start) const;
    // checks a draft call and appends, alone, the queued rows its graph cannot hold: the call that drafts it
    call prepare_draft(int32_t anchor, int start, int n_block);
    // a call's inputs set (the cache's slot positions and n_valid move with them), then after its compute
    void set_inputs(const call & c, const call_inputs & in);
    void after_compute(const call & c);
    // one graph: append m queued rows (padded to n_rows), then draft n_block (0: none)
    void run(int m, int n_rows, int n_block, int32_t anchor, int start);
    struct graph;
    // builds the graph that appends n_rows context rows and drafts n_block positions over n_kv cache slots
    void build(graph & g, int n_rows, int n_block, int n_kv);
    struct graph {
        explicit graph(graph_arena & arena) : cache(arena) {}
        graph_cache     cache;
        int             key_rows = -1, key_block = -1, key_kv = -1;
        ggml_tensor *   ring_rows = nullptr;  // I32 [n_rows]: ring rows of the appended context
        draft_inputs    in;
        ggml_tensor *   top_ids      = nullptr;  // I32 [k, n_block-1]
        ggml_tensor *   top_logprobs = nullptr;  // F32 [k, n_block-1]
        ggml_tensor *   lattice      = nullptr;  // DFlash2: F32 [k, k, n_block-1] (models/dflash2.h)
    };
    int  slot(int64_t position) const { return (int) (position % n_slots_); }
    // run's steps: the appended rows' inputs (m queued, padded to n_rows from position pad_from), the drafted
    // block's (its tokens, positions, slots and attention masks), the block's top-k proposals read back
    void set_context_rows(const call_inputs & in, int m, int n_rows, int pad_from);
    void set_block(const call_inputs & in, int n_block, int n_kv, int32_t anchor, int start);
    // the candidates per position the head reads out: a DFlash2 selector's k (it reranks them all), else top_k_
    int  readout_k() const;
    void fill_block_mask(std::vector<ggml_fp16_t> & mask, int n_block, int n_kv, int start, bool swa) const;
    void read_proposals(const call_outputs & out, int n_block);
    // DFlash2: the selector's path through the read-back candidates and lattice (models/dflash2.h)
    void read_selected(const call_outputs & out, int n_block);
    // DFlash2 with dflash2_tree path / unary: one ranking per position (no per-node conditional ranks)
    void unconditional(const dflash2_ranking & ranked, const int32_t * cand, const float * unary, int64_t P, int64_t k);

    std::shared_ptr<const dflash_draft> draft_;
    uint64_t                            id_;        // (draft_batch's graphs are kept by it)
    bool                                own_pool_;  // no target session's backends were given
    std::shared_ptr<compute_backends>   compute_;  // its target session's, or its own (see core/backend.h)
    std::unique_ptr<feature_ring>       ring_;
    std::unique_ptr<kv_cache>           kv_;
    int                                 block_;
    int                                 window_;
    int                                 top_k_;
    bool                                with_logprobs_;
    selector_tree                       dflash2_tree_;
    int                                 n_slots_;   // window + block
    int                                 n_valid_ = 0;
    std::vector<int32_t>                slot_pos_;  // position held by each cache slot (-1: none)
    // rows to append, in position order; positions between two of them, and from the last to queued_end_, are
    // skipped ones
    std::vector<int32_t>                queued_rows_, queued_pos_;
    int                                 queued_end_ = 0;
    // skipped positions ([from, to), in order, disjoint): missing from the cache on purpose, not overwritten
    std::vector<std::pair<int, int>>    skipped_;
    bool skipped(int position) const;
    // how many of the oldest queued rows (at most limit) one append graph takes
    int  appendable(int limit) const;

    graph_arena     arena_;         // the compute buffer the three graphs below share
    graph           draft_graph_;   // append a round's rows + draft
    graph           append_small_;  // append only, a few rows
    graph           append_large_;  // append only, many
    draft_proposals proposals_;
};

}  // namespace pdf
