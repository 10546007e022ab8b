#include "decode/mtp_proposer.h"
#include "core/clock.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>

namespace pdf {

// weight of a new time in the running average of the head's later steps
static constexpr double STEP_WEIGHT = 0.2;

mtp_proposer::mtp_proposer(const session & s, mtp_session & head, speculation_state & state,
                           const spec_params & params)
    : s_(s), head_(head), state_(state), params_(params) {
    if (params_.mode == spec_mode::tree && head_.top_k() < 2) {
        throw std::invalid_argument("MTP: spec_mode 'tree' needs the head's top_k >= 2 candidates");
    }
}

int mtp_proposer::before_prefill(int reusable) {
    // a reused prefix continues from the head's rows before it and the trunk's state at its last position
    head_.truncate(reusable);
    if (reusable > 0 && head_.n_valid() == std::max(reusable, 1) && head_.restore_state(reusable - 1)) {
        h_row_ = head_.ring().slot(reusable - 1);
        return reusable;
    }
    head_.truncate(0);
    h_row_ = -1;
    return 0;
}

void mtp_proposer::after_prefill_chunk(int first, int n) {
    // row p takes the token at p and the trunk's state at p - 1: this chunk's, or for p = first the one before
    const std::vector<int32_t> & toks = s_.tokens();
    for (int p = std::max(first, 1); p < first + n; ++p) {
        if (p == first && h_row_ < 0) {
            throw std::logic_error(format("MTP: no trunk state before position %d", p));
        }
        head_.queue(toks[p], p, p == first ? h_row_ : head_.ring().slot(p - 1));
    }
    h_row_ = head_.ring().slot(first + n - 1);
    head_.save_state(first + n - 1);
}

void mtp_proposer::propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) {
    drafted_     = false;
    speculative_ = params_.mode != spec_mode::automatic;
    out.reset(anchor);
    max_depth = std::min({max_depth, head_.block() - 1, max_nodes - 1});
    if (max_depth <= 0) {
        return;
    }
    const bool automatic = params_.mode == spec_mode::automatic;
    if (automatic && sits_out_round(state_, batch())) {
        stats_.n_skipped++;
        return;
    }
    drafted_       = true;
    drafted_depth_ = max_depth;  // (auto: as many as candidates() ran the head)
    if (params_.mode == spec_mode::chain) {
        build_draft_chain(run_head(anchor, start, max_depth), anchor, max_depth, out);
    } else if (params_.mode == spec_mode::tree) {
        build_draft_tree(run_head(anchor, start, max_depth), anchor,
                         tree_node_limit(max_nodes, state_.costs, params_.tree_budget), max_depth, params_.seed, out);
    } else if (candidates(anchor, start, max_depth, max_nodes, state_.costs, full_)) {
        const int b = verify_budget(full_, state_.costs, state_.acceptance, s_.is_recurrent());
        out         = full_;
        out.truncate(1 + b);
        speculative_ = b > 0;
        (b == 0 ? stats_.n_plain : out.is_chain() ? stats_.n_chain : stats_.n_tree)++;
    }
}

const draft_proposals & mtp_proposer::run_head(int32_t anchor, int start, int n_steps) {
    const draft_proposals * p = &head_step(head_, true, anchor, start, h_row_);
    while (p->n_positions < n_steps) {
        p = &head_step(head_, false);
    }
    return *p;
}

bool mtp_proposer::candidates(int32_t anchor, int start, int max_depth, int max_nodes, const cost_model & costs,
                              draft_tree & out) {
    // the head runs while drafting on may pay (worth_drafting_on: a draft not worth its own verify width can be
    // with the next ones, and each step costs a run of the head); then its candidates at those positions make a
    // tree, best first by learnt acceptance, that the caller cuts. (Run while its newest draft alone was worth
    // verifying, it stopped at 2 drafts where a third cost next to nothing, and always ran one step past the cut.)
    out.reset(anchor);
    max_depth = std::min({max_depth, head_.block() - 1, max_nodes - 1});
    drafted_  = max_depth > 0;
    if (!drafted_) {
        return false;
    }
    const draft_proposals * p = &head_step(head_, true, anchor, start, h_row_);
    chain_.reset(anchor);
    chain_p_.assign(1, 1.0);
    for (int i = 0;; ++i) {
        chain_.add(p->id(i, 0), i, 0, p->logprob(i, 0));
        chain_p_.push_back(p_accept(chain_, i + 1));
        if (!worth_drafting_on(chain_, chain_p_, costs, step_ms_, max_depth - (i + 1))) {
            break;
        }
        p = &timed_next_step();
    }
    drafted_depth_ = p->n_positions;
    if (costs.grid_widths()) {
        out = chain_;  // on a GPU auto verifies chains (decode/cost_model.h, verifiable)
        return true;
    }
    learnt_scores(*p, state_.acceptance, scores_);
    build_draft_tree(*p, anchor, tree_node_limit(max_nodes, costs, params_.tree_budget), p->n_positions,
                     tree_seed::best_first, out, &scores_);
    return true;
}

const draft_proposals & mtp_proposer::timed_next_step() {
    // without the wait for the other generations' steps in a batch (not this head's cost)
    const auto               t0      = clock_type::now();
    const double             waited0 = eval_batcher::waited_ms();
    const draft_proposals &  p       = head_step(head_, false);
    const double             ms      = std::max(0.0, ms_since(t0) - (eval_batcher::waited_ms() - waited0));
    step_ms_ = step_ms_ > 0.0 ? step_ms_ + STEP_WEIGHT * (ms - step_ms_) : ms;
    return p;
}

double mtp_proposer::p_accept(const draft_tree & t, int b) const {
    return state_.acceptance.p_accept(t.depth[b], t.rank[b], std::exp((double) t.logp[b]));
}

void mtp_proposer::learn(int depth, int rank, float logp, double accepted) {
    state_.acceptance.observe(depth, rank, std::exp((double) logp), accepted);
}

void mtp_proposer::follow(const session & s, const draft_tree & t, int start, const std::vector<int> & rows) {
    // the committed path's rows: its token at start + i with the target's state at the node before it
    const feature_ring & ring = head_.ring();
    if (head_.n_valid() == start) {  // a round that did not draft: the root's row too
        head_.queue(t.tokens[0], start, h_row_);
    }
    for (size_t i = 1; i < rows.size(); ++i) {
        head_.queue(t.tokens[rows[i]], start + (int) i, ring.slot(start + s.eval_slot(rows[i - 1])));
    }
    h_row_ = ring.slot(start + s.eval_slot(rows.back()));
}

void mtp_proposer::after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                                const std::vector<float> & accept_prob) {
    follow(s, t, start, rows);
    if (!drafted_) {
        return;
    }
    learn_from_verify(state_.acceptance, t, accept_prob);
    judge_round();
}

void mtp_proposer::judge_round() {
    if (params_.mode == spec_mode::automatic && judges_itself(batch())) {
        judge_speculation(state_);
    }
}

int mtp_proposer::node_limit(int max_nodes) {
    return tree_node_limit(std::min(max_nodes, head_.ring().capacity()), state_.costs, params_.tree_budget);
}

}  // namespace pdf
