// The n-gram (prompt lookup) proposer: each round drafts what followed earlier occurrences of the context's last
// tokens (decode/ngram_index.h), with no model. Its modes are DFlash's (decode/proposer.h):
//   chain  the most likely continuation (the longest, most recent match), up to block - 1 tokens
//   tree   the distinct continuations merged into one tree (their shared prefixes once), up to tree_budget nodes
//   auto   the tree cut where verifying more would cost more than it is expected to commit: each node's
//          acceptance learnt by (depth, rank, match length), each verify width's time measured
// A round without a match decodes plainly, or in auto verifies a guess (the context's most frequent token) when
// a 2-row step is measured to pay for it; only rounds that verify drafts are counted as speculative.
#pragma once

#include "decode/ngram_index.h"
#include "decode/proposer.h"

namespace pdf {

class ngram_proposer : public proposer {
  public:
    // block: the deepest draft is block - 1 tokens; s: the session whose committed tokens are the context
    ngram_proposer(const session & s, ngram_index & index, speculation_state & state, const spec_params & params,
                   int block);

    const std::vector<int> & capture() const override { return none_; }
    ring_set                 rings() override { return {}; }
    int    before_prefill(int reusable) override;
    void   before_eval(int, int) override {}
    void   after_prefill_chunk(int, int) override {}
    void   propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) override;
    void   after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                        const std::vector<float> & accept_prob) override;
    bool         drafted() const override { return drafted_; }
    cost_model * costs() override { return &state_.costs; }
    bool         learning() const override { return !state_.acceptance.learnt(); }
    int          max_depth() const override { return block_ - 1; }
    bool         speculative_round() const override { return speculative_; }

    const auto_stats & stats() const { return stats_; }

  private:
    const session &     s_;
    ngram_index &       index_;
    speculation_state & state_;
    spec_params         params_;
    int                 block_;
    bool                synced_      = false;  // the index checked against the session's tokens this generation
    bool                drafted_     = false;
    bool                speculative_ = false;
    draft_tree          full_;
    auto_stats          stats_;
    std::vector<int>    none_;
};

// the candidates merged into one tree below `anchor` (a candidate's tokens one path; shared prefixes once), at
// most `budget` nodes below the root, candidates in order. A node's log-probability stands for its match length
// (the acceptance model's bin: ngram_prior); rank: its place among its siblings
void build_ngram_tree(const std::vector<ngram_candidate> & candidates, int32_t anchor, int budget, draft_tree & out);

// the prior probability that the target accepts a continuation token of a match of n tokens (0: a guess with no
// match; the acceptance model's bin, and its prior until rounds teach it otherwise)
double ngram_prior(int match_len);

}  // namespace pdf
