// Continuous batching across threads: the generations running over sessions of one model (each in a thread of
// its own: pydflash serve --parallel N, Model.generate_batch) meet at each of their evaluations, and one
// target evaluation (state/session_batch.h) runs all of them. A generation's rows come out as they would alone, so
// each generation commits what it would alone. A generation that is alone evaluates alone (session::eval).
// Within a step, before the evaluation: the generations that draft meet too, and one drafter graph
// (state/draft_batch.h) drafts for all of them; then the ones running auto offer their candidate trees, and the
// batch plans what each verifies (state/step_plan.h). A step waits only for what every member hands in: a
// member that drafts nothing hands in its part (or its offer) directly.
//
//   eval_batcher batcher(model);              // one per model, shared by its sessions' generations
//   { eval_batcher::member m(batcher);        // a generation, in its own thread
//     batcher.eval(part); ... }               // returns when this part's results are in its session
#pragma once

#include "state/draft_batch.h"
#include "state/mtp_batch.h"
#include "state/session_batch.h"
#include "state/step_plan.h"
#include "state/step_times.h"

#include <atomic>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace pdf {

class eval_batcher {
  public:
    explicit eval_batcher(std::shared_ptr<const target_model> model);

    // one generation using the batcher while it lives: each step's evaluation waits for every member's part
    class member {
      public:
        explicit member(eval_batcher & b);
        ~member();
        member(const member &)             = delete;
        member & operator=(const member &) = delete;

      private:
        eval_batcher & b_;
    };

    // Evaluates `part` as session::eval would, together with the parts the other members hand in for this step:
    // the member whose part completes the step evaluates them (prompt micro-batches up to two of them: the rest
    // wait for the next step), the others wait. Returns the ms the evaluation
    // took (without the wait for the others' parts), a batch's split among its parts by state/step_times.h;
    // throws what evaluating this part alone would throw (a batch
    // that fails is evaluated part by part, so one part's error is its member's alone).
    double eval(const session_batch::part & part);
    // the compute buffers of its batched graphs (the target's, each drafter's, the MTP head's), as allocated so far
    device_bytes compute_memory() const;

    // The batch's choice for a member running auto (state/step_plan.h): gains[b] = P(the accepted path of its
    // round's candidate tree reaches node b+1), best first. Waits until every other member has handed in its
    // part or its own offer, then returns how many of those nodes to verify in the coming step; -1: decide alone
    // (no other member, or no step of this many parts measured yet).
    int plan(const std::vector<double> & gains);

    // A member's draft (draft_session::draft's arguments): waits until every other member has handed in a draft,
    // an offer or a part, then drafts all of this step's drafts in one drafter graph (state/draft_batch.h; alone
    // where they cannot share one). Returns d's proposals; throws what d.draft() would.
    const draft_proposals & draft(draft_session & d, int32_t anchor, int start, int n_block);
    // A member's step of the target's own MTP head, likewise (first: h.begin(anchor, start, h_row), else
    // h.next()): this step's head steps at step 0, and those past it, each run in one graph (state/mtp_batch.h)
    const draft_proposals & draft_head(mtp_session & h, bool first, int32_t anchor = 0, int start = 0,
                                       int h_row = 0);

    // ms this thread has waited in plan(), draft() and draft_head() for the other members (their drafting):
    // not its own cost (a draft batch's compute counts for each of its drafts in equal shares)
    static double waited_ms();

    // what it has done so far: batched evaluations (steps of several members) and the parts they held, parts
    // evaluated alone (a member alone, or a failed batch's)
    struct counts {
        uint64_t batches = 0, batched_parts = 0, alone = 0;
        double   batched_ms = 0.0;  // the batched evaluations' time
        uint64_t max_rows   = 0;    // the most rows one batched evaluation held
        uint64_t planned    = 0;    // steps whose offers the batch's plan cut
        uint64_t draft_batches = 0, batched_drafts = 0;  // drafter graphs over several members, their drafts
        uint64_t head_batches = 0, batched_head_steps = 0;  // MTP head graphs over several members, their steps
        uint64_t cooldowns = 0;                            // the batch's cool-downs begun
        uint64_t step_shapes = 0;  // step shapes (parts, rows) whose times it holds (step_times_measured's)
        uint64_t one_by_one  = 0;  // steps of several parts run part by part (one_by_one())
    };
    counts stats() const;
    // what its steps measured (state/step_times.h: parts -> rows -> ms), once no step is running, and a table
    // saved so (std::invalid_argument for a shape no step has: nothing restored then)
    std::map<int, std::map<int, double>> step_times_measured() const;
    void                                 restore_step_times(const std::map<int, std::map<int, double>> & table);
    // the tile a speculative step's rows come in (the target's verify_row_tile, models/model.h)
    int      row_tile() const { return row_tile_; }
    // evaluations so far (batched or alone)
    uint64_t steps() const { return steps_.load(); }
    // whether other generations run beside the caller's (the batch then decides what its auto generations verify
    // and when they draft)
    bool     shared() const;
    // whether the batch is in a cool-down: its auto generations draft nothing this step (a plan found drafting
    // not paying: judge)
    bool     sits_out() const;

  private:
    struct request {
      const session_batch::part * part = nullptr;
      bool                        done = false;
      double                      ms   = 0.0;
      std::exception_ptr          error;
    };
    struct offer {
        const std::vector<double> * gains = nullptr;
        bool                        done  = false;
        int                         width = -1;
    };
    struct draft_request {
        draft_batch::part  part;  // a DFlash drafter's draft, or (head.h) a step of the target's MTP head
        mtp_batch::part    head;
        bool               done     = false;
        double             share_ms = 0.0;  // its share of the drafting's compute
        std::exception_ptr error;
    };
    // me handed in and waited for: false when the caller is alone (it drafts by itself); rethrows its error
    bool                   draft_in_step(draft_request & me);
    // the step's drafts, in one graph where they can share one (without the lock); the DFlash and the MTP
    // graphs run over several members
    std::pair<bool, bool>  run_drafts(const std::vector<draft_request *> & group);
    bool                   draft_together(const std::vector<draft_request *> & requests);  // false: not drafted
    bool                   heads_together(const std::vector<draft_request *> & requests);  // (likewise)
    static void            draft_alone(draft_request & r);
    // the caller is the only member and nothing of another's is pending: it evaluates, drafts and decides alone
    // (under the lock)
    bool                   alone() const;
    // which of the waiting parts the next step evaluates (the rest wait for the one after)
    std::vector<bool>      next_step() const;
    // the parts of the waiting ones that this step evaluates (taken out of waiting_)
    std::vector<request *> take_step();
    // every waiting offer's width, for the step of the waiting parts and the offers (under the lock)
    void                   plan_offers();
    // after a plan: a cool-down of the batch's drafting when the plan with this step's drafting runs behind plain
    // decoding (under the lock)
    void                   judge(const step_plan & plan);
    // the step's parts, evaluated (without the lock), batch_ms the batch's time; false: each alone
    bool run(const std::vector<request *> & group, double & batch_ms);
    // whether a step of these parts runs part by part (the leader's, while running_): plain decoding (a row per
    // part) where a part alone was measured cheaper than its share of the step together. A part alone is
    // measured (twice: the first builds its graph) once a step together is; and every RECHECK_EVERY plain steps
    // the other way runs, as contexts grow. (On a CPU's repacked Q4_0 kernels at a real model's width 2 rows
    // cost what 2 steps of 1 do, and the batch's graph adds to that: 12.3 against 2 x 5.6 ms on a 2-core Zen 5
    // at width 768, docs/benchmarks.md.)
    bool one_by_one(const std::vector<request *> & group);
    static constexpr int RECHECK_EVERY = 64;
    // each part evaluated alone, one after another, and timed (without the lock); learn: the parts are plain
    // (a row each), and a part alone's time is learnt (one_by_one()'s steps; not a failed batch's parts)
    void run_one_by_one(const std::vector<request *> & group, bool learn);

    const int               row_tile_;         // a speculative step's rows, in whole tiles (models/model.h)
    session_batch           batch_;
    step_times              times_;            // (a leader's while running_, else under the lock)
    mutable std::mutex      mutex_;
    mutable std::condition_variable done_;
    int                     members_ = 0;
    bool                    running_ = false;  // a step's evaluation or drafts are running
    std::vector<request *>  waiting_;          // the next step's parts so far
    std::vector<offer *>    offers_;           // the members waiting for the plan of the next step
    std::vector<draft_request *> drafts_;      // the members waiting for this step's drafts
    std::map<const dflash_draft *, std::unique_ptr<draft_batch>> draft_batches_;  // by drafter (a leader's)
    std::unique_ptr<mtp_batch>   head_batch_;  // the target's MTP head (a leader's)
    counts                  counts_;           // (under the lock)
    std::atomic<uint64_t>   steps_{0};
    double                  drafted_ms_ = 0.0;  // the coming step's drafting, so far (under the lock)
    uint64_t                cool_until_ = 0;    // the batch drafts nothing before this step (under the lock)
    uint64_t                cool_len_   = 0;    // the next cool-down's length (0: the shortest)
    uint64_t                plain_steps_ = 0;   // steps of several plain parts (the leader's, while running_)
};

}  // namespace pdf
