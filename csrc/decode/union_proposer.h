// auto over two proposers at once: a DFlash drafter's candidates and n-gram lookup's merged into one tree (a token
// both propose under the same parent is one node), ordered best first by the probability that the target accepts
// each path, and cut where verifying more would cost more than it is expected to commit (choose_verify_budget).
// So each round verifies the drafter's drafts, the lookup's, both, or nothing, whichever pays. A node's
// acceptance is the better of what each proposer that drafted it has learnt for nodes like it; each learns from
// its own nodes only. A lookup node the drafter did not propose (it drafted another token there) is far less
// likely to be accepted than the lookup's nodes in general (measured: 7% against 52%), so those are learnt
// apart (against_drafter). The drafter keeps its cool-down (decode/proposer.cpp): while it waits, the lookup,
// which costs nothing to draft, still proposes.
#pragma once

#include "decode/ngram_index.h"
#include "decode/ngram_proposer.h"
#include "decode/proposer.h"

namespace pdf {

class union_proposer : public proposer {
  public:
    // dflash: an auto-mode drafter proposer; ngram_acceptance: what the lookup's nodes have taught (kept across
    // generations with the index)
    union_proposer(const session & s, dflash_proposer & dflash, ngram_index & index,
                   acceptance_model & ngram_acceptance, acceptance_model & against_drafter);

    const std::vector<int> & capture() const override { return dflash_.capture(); }
    feature_ring *           ring() override { return dflash_.ring(); }
    int    before_prefill(int reusable) override;
    void   before_eval(int first, int n) override { dflash_.before_eval(first, n); }
    void   after_prefill_chunk(int first, int n) override { dflash_.after_prefill_chunk(first, n); }
    void   propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) override;
    void   after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                        const std::vector<float> & accept_prob) override;
    bool         drafted() const override { return drafter_drafted_ || !lookup_.empty(); }
    cost_model * costs() override { return dflash_.costs(); }
    void         plan_in(eval_batcher * batch) override {
        proposer::plan_in(batch);
        dflash_.plan_in(batch);  // (its drafts)
    }
    int          max_depth() const override { return dflash_.max_depth(); }
    bool         speculative_round() const override { return speculative_; }

    const auto_stats & stats() const { return stats_; }

  private:
    // what proposed a node of the merged tree: the drafter (its rank and log-probability) and / or the lookup
    struct origin {
        int   drafter_rank = -1;  // -1: not the drafter's
        float drafter_logp = 0.0f;
        int   lookup_rank  = -1;  // -1: not the lookup's
        float lookup_logp  = 0.0f;
        bool  against      = false;  // the lookup's alone, where the drafter drafted another token
    };
    // the drafter's tree and the lookup's candidates (each at most max_depth deep) merged into merged_ (origins_,
    // p_ per node)
    void merge(int32_t anchor, int max_depth);
    // a verified round's nodes and accepted nodes by proposer (stats_)
    void count(const draft_tree & t, const std::vector<int> & rows);
    // each node's children's acceptances capped to sum to at most 1 (the target picks one token)
    void exclusive_siblings();
    // merged_ reordered best first by path probability into out (origins and probabilities with it), at most
    // `limit` nodes below the root
    void order_best_first(int limit, draft_tree & out);

    const session &              s_;
    dflash_proposer &            dflash_;
    ngram_index &                index_;
    acceptance_model &           ngram_acceptance_;
    acceptance_model &           against_drafter_;
    bool                         synced_          = false;
    bool                         drafter_drafted_ = false;
    bool                         speculative_     = false;
    std::vector<ngram_candidate> lookup_;
    draft_tree                   drafter_tree_, lookup_tree_, merged_, ordered_;
    std::vector<origin>          origins_, ordered_origins_;
    std::vector<double>          p_, ordered_p_;
    auto_stats                   stats_;
};

}  // namespace pdf
