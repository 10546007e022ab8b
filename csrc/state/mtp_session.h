// The mutable side of a target's own multi-token-prediction head (MTP, target_model::build_mtp) for one target
// session: the ring of trunk states the target's evaluations write, the head's own K/V cache, and its graphs.
//
// The head's row at position p is (token at p, the trunk's final normed hidden state at p - 1): it predicts the
// token at p + 1. Its attention sees the rows of every earlier position, so each committed position's row is
// computed once, with the target's state, into the cache (slot = position; position 0 has no row and its slot
// holds padding). A round's drafts run the head repeatedly, as llama.cpp's draft-mtp does: step 0 is the
// anchor's row (with the trunk's state before it), step i the head over its own draft i - 1 and its own state
// h' of step i - 1. Those later rows are transient: the next round's queue overwrites them with the target's.
// Committed rows are queued and appended in the graph of the next round's step 0, or before a target
// evaluation would overwrite the ring rows they read.
#pragma once

#include "core/graph_cache.h"
#include "models/model.h"
#include "state/draft_session.h"
#include "state/feature_ring.h"
#include "state/kv_cache.h"

#include <map>
#include <memory>
#include <vector>

namespace pdf {

struct mtp_params {
    int  block         = 4;    // tokens per round: the anchor and at most block - 1 drafts
    int  ring_capacity = 512;  // trunk-state rows: > a prefill micro-batch and > a verify's rows
    int  top_k         = 1;    // candidates per drafted position (1: the greedy chain)
    bool with_logprobs = true;
    ggml_type type_k   = GGML_TYPE_F16;  // the head's cache (its target session's types)
    ggml_type type_v   = GGML_TYPE_F16;
};

class mtp_session {
  public:
    // compute: the backends of the target session it drafts for (one thread pool per conversation)
    mtp_session(std::shared_ptr<const target_model> target, uint32_t n_ctx, const mtp_params & params,
                std::shared_ptr<compute_backends> compute);
    ~mtp_session();
    mtp_session(const mtp_session &)             = delete;
    mtp_session & operator=(const mtp_session &) = delete;

    // the ring the target's evaluations write their last layer's output into (session::eval(..., capture, ring))
    feature_ring &           ring() { return *ring_; }
    const std::vector<int> & capture_layers() const { return capture_; }

    // position p's row (token at p; the trunk's state at p - 1 in ring row h_row), after the queued ones
    void queue(int32_t token, int position, int h_row);
    // append everything queued to the cache now
    void flush();
    // a target evaluation is about to write the ring rows of positions [first, first + n): flush first if that
    // would overwrite a ring row the queue reads
    void protect(int first, int n);
    // the trunk's state at `position` (its ring row) kept on the host: a later prompt that reuses the cache up
    // to position + 1 continues from it (restore_state writes it back into its ring row; false: not kept)
    void save_state(int position);
    bool restore_state(int position);
    // n_steps (1 .. block - 1) drafts after `anchor` at `start`, whose trunk state before it is ring row h_row:
    // the top_k candidates of positions start + 1 .. start + n_steps, each step drafting from the previous
    // step's greedy pick
    const draft_proposals & draft(int32_t anchor, int start, int h_row, int n_steps);
    // the same one step at a time: begin() runs step 0 (proposals of position start + 1), each next() the step
    // after (at most block - 2 of them); the proposals grow by one position per step
    const draft_proposals & begin(int32_t anchor, int start, int h_row);
    const draft_proposals & next();
    // forget rows at positions >= n_past, queued ones included
    void truncate(int n_past);
    const std::shared_ptr<const target_model> & shared_target() const { return target_; }
    // the last draft's proposals (begin() and next()'s, or an mtp_batch's)
    const draft_proposals & proposals() const { return proposals_; }

    // rows exist (appended or queued) for every position in [1, n_valid)
    int          n_valid() const;
    int          block() const { return block_; }
    int          top_k() const { return top_k_; }
    // compute buffer bytes of its largest graph over a window of n_kv cache slots (a multiple of window_step(),
    // or n_ctx): the round's (queue + anchor), a step's, the append graphs' (ggml's allocator, nothing allocated;
    // memory plans)
    size_t       measure(int n_kv);
    static int   window_step();
    device_bytes kv_memory() const { return kv_->memory(); }
    device_bytes ring_memory() const { return ring_->memory(); }
    device_bytes compute_memory() const { return arena_.memory(); }

  private:
    friend class mtp_batch;  // runs several sessions' steps in one graph, through the steps below

    // one graph's rows: tokens, positions, the ring rows their states come from (step 0; none from the carry)
    struct step_rows {
        std::vector<int32_t> tokens, positions, ring_rows;
        int                  n_queued = 0;  // step 0: the queued rows it appends
    };
    // begin() up to its graph: checks, appends the queued rows beyond the round graph's, resets the proposals;
    // then the round graph's block rows (padding first, the queued rows, the anchor last)
    step_rows prepare_begin(int32_t anchor, int start, int h_row);
    // after a graph that appended the first m queued rows: they are in the cache
    void      appended(int m);
    // next() up to its graph: checks; the step's one row (the previous step's greedy pick)
    step_rows prepare_next() const;
    // a step's candidates: column `column` of top_ids / top_logprobs [k, n] (nullptr: none read)
    void      read_step(ggml_tensor * top_ids, ggml_tensor * top_logprobs, int column, int step);
    // the rows' masks [n_kv, n]: the row at position p sees positions [1, p] (position 0, padding: slot 0 only)
    static std::vector<ggml_fp16_t> causal_mask(const std::vector<int32_t> & positions, int n_kv);

    struct graph;
    // one graph: n_rows rows whose states come from the ring (m real ones last, padding before), or (from_carry)
    // one row whose state is the carry; with_head: the last row's candidates and state h' (into the carry)
    void build(graph & g, int n_rows, bool from_carry, bool with_head, int n_kv);
    // the first m queued rows padded to n_rows (padding first), with_anchor the anchor's row last
    step_rows rows_of(int m, int n_rows, bool with_anchor, int32_t anchor, int start, int h_row) const;
    void      run_rows(const step_rows & r, bool with_head);
    // appends up to max_rows of the queue in one append graph
    void      append_queued(int max_rows);
    void set_common(graph & g, const std::vector<int32_t> & tokens, const std::vector<int32_t> & pos);
    int  window_for(int last_position) const;

    struct graph {
        explicit graph(graph_arena & arena) : cache(arena) {}
        graph_cache   cache;
        int           key_rows = -1, key_kv = -1;
        bool          key_carry = false, key_head = false;
        eval_inputs   in;
        ggml_tensor * ring_rows    = nullptr;  // I32 [n_rows]
        ggml_tensor * top_ids      = nullptr;  // I32 [k, 1]
        ggml_tensor * top_logprobs = nullptr;  // F32 [k, 1]
    };

    std::shared_ptr<const target_model> target_;
    uint64_t                            id_;  // unique in the process: keys a batch's graphs
    std::shared_ptr<compute_backends>   compute_;
    std::vector<int>                    capture_;
    std::unique_ptr<feature_ring>       ring_;
    std::unique_ptr<kv_cache>           kv_;
    state_buffers                       carry_buf_;
    ggml_tensor *                       carry_ = nullptr;  // F32 [E, 1]: the last step's h'
    int                                 block_, top_k_;
    bool                                with_logprobs_;
    int                                 n_ctx_;
    int                                 n_valid_ = 1;  // rows appended for positions [1, n_valid_)
    int                                 start_   = 0;  // the drafting round's anchor position
    std::vector<int32_t>                queued_tok_, queued_pos_, queued_h_;
    std::map<int, std::vector<float>>   saved_;  // trunk states by position (save_state)

    graph_arena     arena_;
    graph           rows_graph_;    // a round's queue + the anchor's row
    graph           step_graph_;    // one step from the carry
    graph           append_small_;  // append only
    graph           append_large_;
    draft_proposals proposals_;
};

}  // namespace pdf
