// The MTP proposer: the target's own multi-token-prediction head (state/mtp_session.h) drafts each round, with no
// drafter model. Its modes are DFlash's (decode/proposer.h):
//   chain  the head's greedy chain of block - 1 tokens (llama.cpp's draft-mtp)
//   tree   the head's top-k candidates at each of those positions (each step run on the greedy draft before it)
//          as a best-first tree of tree_budget nodes, as DDTree makes of a DFlash drafter's
//   auto   the head run while drafting on may pay (decode/proposer.h worth_drafting_on: the next drafts, as likely
//          as its newest, and their verify against the drafting's time), then that tree cut where verifying more
//          would cost more than it is expected to commit: acceptance learnt by depth and rank against the head's
//          probability, each verify width's time measured; plain rounds (a cool-down) where speculation runs
//          behind plain decoding
#pragma once

#include "decode/proposer.h"
#include "state/mtp_session.h"

namespace pdf {

class mtp_proposer : public proposer {
  public:
    // s: the target session whose committed tokens and trunk states the head continues from
    mtp_proposer(const session & s, mtp_session & head, speculation_state & state, const spec_params & params);

    const std::vector<int> & capture() const override { return head_.capture_layers(); }
    ring_set                 rings() override { return &head_.ring(); }
    int    before_prefill(int reusable) override;
    void   before_eval(int first, int n) override { head_.protect(first, n); }
    void   after_prefill_chunk(int first, int n) override;
    void   propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) override;
    void   after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                        const std::vector<float> & accept_prob) override;
    bool         drafted() const override { return drafted_; }
    int          drafted_depth() const override { return drafted_ ? drafted_depth_ : 0; }
    cost_model * costs() override { return &state_.costs; }
    bool         learning() const override { return !state_.acceptance.learnt(); }
    int          max_depth() const override { return head_.block() - 1; }
    bool         speculative_round() const override { return speculative_; }

    const auto_stats & stats() const { return stats_; }

    // The parts a proposer that merges other candidates with the head's (decode/union_proposer.h) runs:
    // auto's candidate tree of this round (no cool-down: the caller judges), the head run while drafting on may
    // pay at `costs`, best first by learnt acceptance (false, and only the root: no room to draft)
    bool   candidates(int32_t anchor, int start, int max_depth, int max_nodes, const cost_model & costs,
                      draft_tree & out);
    // P(accepted | parent accepted) of node b of a tree candidates() built, as learnt
    double p_accept(const draft_tree & t, int b) const;
    // after a verify: the committed path's rows become the head's context (whether it drafted or not)
    void   follow(const session & s, const draft_tree & t, int start, const std::vector<int> & rows);
    // after a verify: what the target made of one of the head's nodes (as dflash_proposer::learn)
    void   learn(int depth, int rank, float logp, double accepted);
    // auto, before drafting: whether this round decodes plainly (sits_out_round on the head's state)
    bool   sits_out() { return sits_out_round(state_, batch()); }
    // what the decode loop learns about the head (a merge keeps its own choices in the first model's)
    speculation_state & state() { return state_; }
    // after a round that drafted: a cool-down when speculation runs behind plain decoding (auto)
    void   judge_round();
    // tree nodes below the root a round may verify: the budget, within the session, ring and cost model
    int    node_limit(int max_nodes);

  private:
    // the head's greedy chain of n_steps positions after the anchor (in the batch's head graphs when in a batch)
    const draft_proposals & run_head(int32_t anchor, int start, int n_steps);
    // the head's next step (head_step), its time kept in step_ms_
    const draft_proposals & timed_next_step();

    const session &     s_;
    mtp_session &       head_;
    speculation_state & state_;
    spec_params         params_;
    int                 h_row_       = -1;  // the ring row of the trunk state before the next anchor
    bool                drafted_       = false;
    int                 drafted_depth_ = 0;  // the head's runs in the last round
    bool                speculative_   = false;
    draft_tree          chain_, full_;  // auto: the greedy chain drafted, the candidate tree
    std::vector<double> chain_p_;       // auto: P(accepted | parent accepted) of chain_'s nodes, as learnt
    double              step_ms_ = 0.0;  // auto: the head's later steps, ms (a running average; 0: none yet)
    std::vector<float>  scores_;        // auto: log P(accepted | parent accepted) by position, rank
    auto_stats          stats_;
};

}  // namespace pdf
