// auto over several proposers at once: a DFlash drafter's candidates, the target's MTP head's and n-gram lookup's
// (any two of them, or all three) merged into one tree (a token that more than one proposes under the same parent is
// one node), ordered best first by the probability that the target accepts each path, and cut where verifying more
// would cost more than it is expected to commit (choose_verify_budget). So each round verifies the drafter's drafts,
// the head's, the lookup's, any mix of them, or nothing, whichever pays. A node's acceptance is the best of what
// each proposer that drafted it has learnt for nodes like it; each learns from its own nodes only. A lookup node
// that no model proposed, where a model drafted another token, is far less likely to be accepted than the lookup's
// nodes in general (measured: 7% against 52%), so those are learnt apart (against_drafter).
//
// Which models draft a round: each costs a run, timed per round (waits for other sessions left out), so a round
// runs the set of them whose rounds would reach the best rate. A round in which every model drafted rates each
// non-empty subset of them: the cut that subset's nodes alone (with the lookup's) give, its expected committed
// tokens over its drafting time and the verify's, relative to every model's together (so that sets are compared
// within a round, not across rounds whose contexts differ), apart for rounds where the lookup matched and where
// it did not (it runs first, at no cost, so a round knows which it is). All of them draft in the first few rounds
// and then every PROBE_EVERY rounds (probes), less often while probes keep rating the same set best, so that
// the sets are rated again; and in the round after a cool-down, which the set chosen before it set off. Probes
// are not judged (nor rated as speculation, decode/cost_model.h): the set chosen after a cool-down's probe is,
// as a lone model's first round after one. Rounds without any model are the cool-down's (decode/proposer.cpp;
// the first model's, the drafter's, else the head's), not a set chosen here: the lookup's acceptance is learnt
// beside models that drafted too, and overrates it alone. While the cool-down waits, the lookup, which costs
// nothing, still proposes.
#pragma once

#include "decode/mtp_proposer.h"
#include "decode/ngram_index.h"
#include "decode/ngram_proposer.h"
#include "decode/proposer.h"

#include <algorithm>
#include <array>

namespace pdf {

// n-gram lookup merged with models' drafts: its index of the session's tokens, what its nodes have taught (kept
// across generations with the index), and what its nodes taught where a model drafted another token
struct lookup_source {
    ngram_index &      index;
    acceptance_model & acceptance;
    acceptance_model & against_drafter;
};

class union_proposer : public proposer {
  public:
    // at least two of: an auto-mode DFlash proposer, an auto-mode MTP proposer, n-gram lookup (nullptr: not it)
    union_proposer(const session & s, dflash_proposer * dflash, mtp_proposer * mtp, const lookup_source * lookup);

    const std::vector<int> & capture() const override { return capture_; }
    ring_set                 rings() override;
    int    before_prefill(int reusable) override;
    void   before_eval(int first, int n) override;
    void   after_prefill_chunk(int first, int n) override;
    void   propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) override;
    void   after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                        const std::vector<float> & accept_prob) override;
    bool         drafted() const override { return drafted_[0] || drafted_[1] || !lookup_.empty(); }
    // the deepest its models drafted (the lookup's matches aside)
    int          drafted_depth() const override {
        return std::max(drafted_[DFLASH] ? dflash_->drafted_depth() : 0, drafted_[MTP] ? mtp_->drafted_depth() : 0);
    }
    int          drafted_models() const override { return (drafted_[DFLASH] ? 1 : 0) | (drafted_[MTP] ? 2 : 0); }
    cost_model * costs() override { return dflash_ ? dflash_->costs() : mtp_->costs(); }
    bool         learning() const override { return dflash_ ? dflash_->learning() : mtp_->learning(); }
    bool         probing() const override { return probing_; }
    void         plan_in(eval_batcher * batch) override;
    int          max_depth() const override;
    bool         speculative_round() const override { return speculative_; }

    const auto_stats & stats() const { return stats_; }

    // rounds between two in which every model drafts (the others run the best-rated set), after the first
    // FIRST_PROBES rounds (of those where the lookup matched, and of the others), in which every model drafts;
    // up to PROBE_EVERY_MAX while probes keep rating the same set best
    static constexpr int PROBE_EVERY     = 8;
    static constexpr int PROBE_EVERY_MAX = 64;
    static constexpr int FIRST_PROBES    = 4;

  private:
    static constexpr int DFLASH = 0, MTP = 1, N_MODELS = model_set_rates::N_MODELS;  // (bit k of a set: model k)
    static constexpr int LOOKUP = 2, N_SOURCES = 3;  // every source of nodes
    // what proposed a node of the merged tree: per source, its rank and log-probability (rank -1: not it), and
    // the acceptance it has learnt for such a node
    struct origin {
        std::array<int, N_SOURCES>    rank{-1, -1, -1};
        std::array<float, N_SOURCES>  logp{};
        std::array<double, N_SOURCES> p{};
        bool   against   = false;  // the lookup's, no model's, where a model drafted another token
        double p_against = 0.0;    // the lookup's acceptance if it were (the drafted models left out)
    };
    // the set of every model given; the best-rated set (where the lookup matched: m 1, else 0); the set of models
    // that draft this round (every model in a probe round); after a probe, when the next one comes
    int  all_models() const;
    int  best_set(int m) const;
    int  choose_models();
    void schedule_probe(int m);
    // model k's candidate tree into trees_[k], timed; whether it drafted
    bool draft_model(int k, int32_t anchor, int start, int max_depth, int max_nodes);
    // source k's tree t merged into merged_ (p(t, j, its merged node's origin): the acceptance learnt for node j)
    template <class P> void absorb(const draft_tree & t, int k, P p);
    // every proposed tree merged into merged_ (origins_)
    void merge(int32_t anchor, int max_depth);
    // the lookup's acceptance of merged node b if only the models of `models` (a set) had drafted
    double lookup_p(int b, int models) const;
    // per merged node, the acceptance that nodes of `models` (a set) and the lookup's give it (-1: none of
    // theirs), each node's children capped to sum to at most 1 (the target picks one token)
    void node_p(int models, std::vector<double> & p) const;
    // merged_ reordered best first by path probability (p per node; p < 0: left out) into out, at most `limit`
    // nodes below the root; origins and probabilities with it. chain: one path, the likeliest child of the last
    // node taken at each step (on a GPU auto verifies chains: decode/cost_model.h)
    void order_best_first(const std::vector<double> & p, int limit, bool chain, draft_tree & out,
                          std::vector<origin> & origins, std::vector<double> & out_p) const;
    // after every model drafted: each non-empty subset of them rated by the cut its nodes alone would have given
    // (rates_.relative; a probe's also schedules the next)
    void rate_model_sets(int limit);
    // a verified round's nodes and accepted nodes by proposer (stats_)
    void count(const draft_tree & t, const std::vector<int> & rows);
    int  node_limit(int max_nodes);

    const session &            s_;
    dflash_proposer *          dflash_;
    mtp_proposer *             mtp_;
    const lookup_source *      lookup_source_;
    std::vector<int>           capture_;  // the drafter's layers, then the head's
    bool                       synced_      = false;
    std::array<bool, N_MODELS> drafted_{};
    bool                       speculative_ = false;
    bool                       probing_     = false;  // every model drafts this round
    bool                       reprobe_     = false;  // this round probes after a cool-down
    std::vector<ngram_candidate> lookup_;
    std::array<draft_tree, N_MODELS> trees_;
    draft_tree                 lookup_tree_, merged_, ordered_, trial_;
    std::vector<origin>        origins_, ordered_origins_, trial_origins_;
    std::vector<double>        p_, ordered_p_, trial_p_;
    model_set_rates &          rates_;  // (the first model's state's: kept across generations)
    auto_stats                 stats_;
};

}  // namespace pdf
