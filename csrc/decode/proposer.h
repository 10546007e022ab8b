// Proposers: what the decode loop (decode/driver.h) verifies each round. A proposal is a tree of drafts below
// the round's root (the anchor token): just the root (plain decoding), a chain, or a DDTree tree.
//   plain_proposer   no drafter: every round is one target step
//   dflash_proposer  a DFlash drafter, in one of three modes:
//                      chain  the drafter's top-1 chain of block-1 tokens (DFlash as published)
//                      tree   the best-first tree of `tree_budget` nodes (DDTree)
//                      auto   per round, whatever maximises expected committed tokens per unit of time:
//                             no draft at all, a chain or a tree of any size, from the learnt probability that
//                             the target accepts each drafted path (decode/acceptance_model.h) and the measured
//                             cost of each verify width (decode/cost_model.h); it drafts only as deep as its
//                             last cut suggests it will verify (decode/proposer.cpp, MIN_DRAFT_DEPTH)
#pragma once

#include "decode/acceptance_model.h"
#include "decode/cost_model.h"
#include "decode/tree.h"
#include "state/draft_session.h"
#include "state/eval_batcher.h"
#include "state/session.h"

#include <array>
#include <cstdint>
#include <vector>

namespace pdf {

// auto's choice for one round: how many nodes of `full` (in its order, each prefix a tree) to verify, 0 for a
// plain step. Maximises expected committed tokens (1 + the summed probabilities that the target accepts each
// node's path) minus the best achievable rate times the verify's time (Dinkelbach): a node is worth verifying
// when what it is expected to add exceeds what its share of the verify would have produced elsewhere. A prefix
// that branches is no wider than the widest chain measured (or 8 nodes): past it its time would be a guess on a
// guess.
int choose_verify_budget(const draft_tree & full, const cost_model & costs, const acceptance_model & acceptance,
                         bool recurrent_target);
// the same with each node's P(accepted | parent accepted) given (p_accept[b] for node b; the root's unused)
int choose_verify_budget(const draft_tree & full, const std::vector<double> & p_accept, const cost_model & costs,
                         bool recurrent_target);
// that choice (nodes below the root) and its gain: expected committed tokens less the rate times the verify's ms
struct verify_cut {
    int    nodes;
    double gain;
};
verify_cut best_verify_cut(const draft_tree & full, const std::vector<double> & p_accept, const cost_model & costs,
                           bool recurrent_target);
// For a proposer that drafts a chain one step at a time (the MTP head): whether drafting on may pay, that is,
// whether verifying j more drafts (j <= max_more), each reached given its parent as often as the newest one
// was, for step_ms of drafting each, would gain more than the best cut of `chain` as drafted now. The next
// draft alone need not pay for it: verify times grow in steps (on the CPU ggml's repacked matmul kernels take
// rows four at a time, so a chain of 3 costs about what one of 4 does), and one draft that is not worth its
// own width can be with the next ones.
bool worth_drafting_on(const draft_tree & chain, const std::vector<double> & p_accept, const cost_model & costs,
                       double step_ms, int max_more);

class proposer {
  public:
    virtual ~proposer() = default;

    // the target layers to capture during evaluations and the rings they go to (none: empty), in order
    virtual const std::vector<int> & capture() const = 0;
    virtual ring_set                 rings()         = 0;
    // before prefill: the session will continue from its first `reusable` committed tokens; returns how many of
    // them this proposer can continue from (`reusable`, or 0), having cut its own state back to that
    virtual int before_prefill(int reusable) = 0;
    // a target evaluation is about to write the capture rows of positions [first, first + n)
    virtual void before_eval(int first, int n) = 0;
    // prefill committed positions [first, first + n) (captured into the ring)
    virtual void after_prefill_chunk(int first, int n) = 0;
    // the tree to verify in a round whose root `anchor` sits at position `start`: drafts at most `max_depth`
    // deep, at most `max_nodes` nodes in all (root included)
    virtual void propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) = 0;
    // the target evaluated `t` and is about to commit `rows` (root first) of it; accept_prob: per node, the
    // probability that the target chose it after its parent (-1: its parent was not reached). The round's
    // costs are in costs() by now.
    virtual void after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                              const std::vector<float> & accept_prob) = 0;
    // whether the evaluation of the round the last propose() began captures (capture(), rings()); else it
    // captures nothing and after_verify knows it
    virtual bool captures_round() const { return true; }
    // whether the last propose() ran the drafter
    virtual bool drafted() const = 0;
    // how many positions past the anchor the last propose() drafted (0: none; traced rounds)
    virtual int  drafted_depth() const { return 0; }
    // merged proposers: which of their models the last propose() ran, bit 0 the DFlash drafter, bit 1 the MTP
    // head (traced rounds; a lone proposer: 0)
    virtual int  drafted_models() const { return 0; }
    // where the decode loop reports what each round cost (what auto weighs); nullptr: nothing weighs it
    virtual cost_model * costs() = 0;
    // whether auto chose the last round before its acceptance model was learnt (acceptance_model::learnt): such
    // a round says little of what speculation reaches, and is not rated (cost_model::round::learning)
    virtual bool learning() const { return false; }
    // whether the last round was merged proposers' probe (every model drafting, decode/union_proposer.h): not
    // what auto chose, and not rated either (cost_model::round::probe)
    virtual bool probing() const { return false; }
    // the deepest draft a round can verify (0: no drafter)
    virtual int max_depth() const = 0;
    // whether the last propose() began a speculative round (counted in n_rounds / tau): chain and tree modes
    // count every round, as the reference loops do (also a last one that drafts nothing), auto only the rounds
    // it chose to verify drafts in
    virtual bool speculative_round() const = 0;

    // while a generation runs in a batch of them (decode/driver.h), its drafts run in the batch's drafter graphs
    // and auto's cut is the batch's plan (state/eval_batcher.h: draft, plan); nullptr: alone
    virtual void plan_in(eval_batcher * batch) { batch_ = batch; }

  protected:
    // auto's cut of a round's candidate tree `full` (every prefix a tree): how many of its nodes below the root
    // to verify, as the batch plans it, or alone as choose_verify_budget chooses
    int verify_budget(const draft_tree & full, const std::vector<double> & p_accept, const cost_model & costs,
                      bool recurrent_target);
    int verify_budget(const draft_tree & full, const cost_model & costs, const acceptance_model & acceptance,
                      bool recurrent_target);
    eval_batcher * batch() const { return batch_; }
    // d.draft(...), in the batch's drafter graph with the other generations' drafts when in a batch
    const draft_proposals & draft_block(draft_session & d, int32_t anchor, int start, int n_block) {
        return batch_ ? batch_->draft(d, anchor, start, n_block) : d.draft(anchor, start, n_block);
    }
    // the MTP head's step 0 (first: h.begin(anchor, start, h_row)) or next step (h.next()), in the batch's head
    // graph with the other generations' steps when in a batch
    const draft_proposals & head_step(mtp_session & h, bool first, int32_t anchor = 0, int start = 0,
                                      int h_row = 0) {
        if (batch_) {
            return batch_->draft_head(h, first, anchor, start, h_row);
        }
        return first ? h.begin(anchor, start, h_row) : h.next();
    }

  private:
    eval_batcher * batch_ = nullptr;
};

class plain_proposer : public proposer {
  public:
    const std::vector<int> & capture() const override { return none_; }
    ring_set                 rings() override { return {}; }
    int    before_prefill(int reusable) override { return reusable; }
    void   before_eval(int, int) override {}
    void         after_prefill_chunk(int, int) override {}
    void         propose(int32_t anchor, int, int, int, draft_tree & out) override { out.reset(anchor); }
    void         after_verify(const session &, const draft_tree &, int, const std::vector<int> &,
                              const std::vector<float> &) override {}
    bool         drafted() const override { return false; }
    cost_model * costs() override { return nullptr; }
    int          max_depth() const override { return 0; }
    bool         speculative_round() const override { return false; }

  private:
    std::vector<int> none_;
};

enum class spec_mode { chain, tree, automatic };

struct spec_params {
    spec_mode mode        = spec_mode::automatic;
    int       tree_budget = 0;  // tree: draft nodes verified per round; auto: the most it may verify (0: the
                                // session's limit)
    tree_seed seed        = tree_seed::best_first;
};

// What auto over merged proposers (decode/union_proposer.h) learns of which models to run: each model's drafting
// time, and each set of them's rate relative to every model's, apart for rounds where n-gram lookup matched or not
struct model_set_rates {
    static constexpr int N_MODELS = 2;  // a DFlash drafter, the MTP head
    std::array<double, N_MODELS>                       model_ms{};
    std::array<int, N_MODELS>                          model_runs{};
    std::array<std::array<double, 1 << N_MODELS>, 2>   relative{};
    std::array<int, 2>                                 rated{};  // rounds that rated them
    int                                                rounds = 0;  // rounds that could draft
    // the probes' schedule: the round of the next, the rounds between two, the set each kind's last one rated best
    int                                                next_probe  = 0;
    int                                                probe_every = 0;
    std::array<int, 2>                                 probe_best{-1, -1};
    bool                                               cooled = false;  // a cool-down since the last round chosen
};

// What the decode loop learns about a drafter on this machine, kept across generations: the costs, how far the
// drafter's probabilities can be trusted, and auto's cool-down (plain rounds before it drafts again); merged with
// other proposers, which of them to run
struct speculation_state {
    explicit speculation_state(int max_verify) : costs(max_verify) {}
    cost_model       costs;
    acceptance_model acceptance;
    int              cooldown = 0;  // rounds left to decode plainly before drafting again
    int              cool_len = 0;  // the next cool-down's length (0: the shortest)
    int              draft_depth = 0;  // auto, alone: positions its next draft covers (0: none chosen yet)
    // auto, alone: a fresh run of speculation's rated rounds still to come before it is judged, and what they
    // committed in how long so far (decode/proposer.cpp judge_speculation)
    int              probe_left   = 0;
    double           probe_tokens = 0.0, probe_ms = 0.0;
    model_set_rates  merged;
};

// auto, after a round that drafted: a cool-down of plain rounds when speculation runs behind plain decoding, the
// next one longer each time it fails again
void judge_speculation(speculation_state & state);
// auto, before drafting: whether this round decodes plainly instead (a cool-down round, counted down; or a fresh
// process's first round, which measures a plain step). Beside other generations (`batch` shared), the batch's
// cool-down instead of the generation's own: its generations stop drafting and resume together, so the batch's
// plan weighs their candidates in one step. (One generation's verify beside plain ones rarely pays where
// everyone's would: on the cost-realistic qwen3 pair a step of 2 rows costs what 1 row does, 5 rows twice that,
// 8 rows 2.4 times. Judged each on its own, they were cut alone and cooled down out of step: at N = 2 they
// offered together in 1 plan of 30.)
bool sits_out_round(speculation_state & state, const eval_batcher * batch = nullptr);
// whether a generation judges its own drafting after a drafted round (judge_speculation): unless it runs beside
// other generations, whose batch judges for all of them
bool judges_itself(const eval_batcher * batch);
// draft nodes below the root a round may verify: max_nodes less the root, within the widths the cost model covers
// and the tree budget (0: none)
int  tree_node_limit(int max_nodes, const cost_model & costs, int tree_budget);
// scores [n_positions, top_k]: log P(accepted | parent accepted) of each candidate of p, as learnt (non-increasing in
// rank): what orders a proposer's tree best first by the target's acceptance rather than the drafter's belief
void learnt_scores(const draft_proposals & p, const acceptance_model & acceptance, std::vector<float> & scores);
// after a verify: what the target made of every node whose parent it reached (accept_prob[b] >= 0)
void learn_from_verify(acceptance_model & acceptance, const draft_tree & t, const std::vector<float> & accept_prob);

// what auto decided, for the timings
struct auto_stats {
    int n_skipped = 0;  // rounds that decoded plainly without drafting (speculation was not paying)
    int n_plain   = 0;  // rounds that drafted but verified nothing (the drafter was not sure enough)
    int n_chain   = 0;  // rounds that verified a chain
    int n_tree    = 0;  // rounds that verified a branching tree
    // merged proposers (decode/union_proposer.h), by proposer (0: the DFlash drafter, 1: n-gram lookup, 2: the
    // MTP head; a node several proposed counts for each): rounds it drafted in (a model's run; the lookup's
    // matches), verified rounds with a node of it, its nodes verified, its nodes accepted
    int ran_by[3]      = {0, 0, 0};
    int rounds_by[3]   = {0, 0, 0};
    int drafted_by[3]  = {0, 0, 0};
    int accepted_by[3] = {0, 0, 0};
};

class dflash_proposer : public proposer {
  public:
    dflash_proposer(draft_session & d, speculation_state & state, const spec_params & params, bool recurrent_target);

    const std::vector<int> & capture() const override { return d_.model().capture_layers(); }
    ring_set                 rings() override { return &d_.ring(); }
    int    before_prefill(int reusable) override;
    void   before_eval(int first, int n) override { d_.protect(first, n); }
    void         after_prefill_chunk(int first, int n) override;
    void         propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) override;
    void         after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                              const std::vector<float> & accept_prob) override;
    // auto's plain rounds far from its next draft capture nothing: no draft reads their features
    bool         captures_round() const override { return captures_; }
    bool         drafted() const override { return drafted_; }
    int          drafted_depth() const override { return drafted_ ? drafted_depth_ : 0; }
    cost_model * costs() override { return &costs_; }
    bool         learning() const override { return !acceptance_.learnt(); }
    int          max_depth() const override { return d_.block() - 1; }
    bool         speculative_round() const override { return speculative_; }

    const auto_stats & stats() const { return stats_; }

    // The parts a proposer that merges other candidates with the drafter's (decode/union_proposer.h) runs:
    // auto's candidate tree of this round, best first by learnt acceptance, at most max_nodes nodes (false, and
    // only the root: a cool-down round, or no room to draft)
    bool   draft_candidates(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out);
    // the same without the cool-down (the caller judges): drafts unless there is no room to; `depth` > 0: at most
    // that many positions (else the whole block)
    bool   candidates(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out, int depth = 0);
    // auto, before drafting: whether this round decodes plainly (sits_out_round on this drafter's state)
    bool   sits_out() { return sits_out_round(state_, batch()); }
    // what the decode loop learns about this drafter (a merge keeps its choices of models here)
    speculation_state & state() { return state_; }
    // P(accepted | parent accepted) of node b of a tree draft_candidates built, as learnt
    double p_accept(const draft_tree & t, int b) const;
    // after a verify: the accepted nodes' features become the drafter's context rows
    void   queue_context(const session & s, int start, const std::vector<int> & rows);
    // after a verify: what the target made of one of the drafter's nodes (its depth, rank and log-probability;
    // `accepted`: the probability that the target chose it after its parent)
    void   learn(int depth, int rank, float logp, double accepted);
    // after a round that drafted: a cool-down when speculation runs behind plain decoding (auto)
    void   judge_round();

    // tree nodes below the root a round may verify: the budget, within the session, feature ring and cost model
    int    node_limit(int max_nodes);

  private:

    draft_session &                       d_;
    speculation_state &                   state_;
    cost_model &                          costs_;
    acceptance_model &                    acceptance_;
    spec_params                           params_;
    bool                                  recurrent_;
    draft_tree                            full_;    // auto: the candidate tree a round's choice cuts
    std::vector<float>                    scores_;  // auto: log P(accepted | parent accepted) by position, rank
    bool                                  drafted_     = false;
    bool                                  speculative_ = false;
    bool                                  captures_    = true;
    int                                   drafted_depth_ = 0;  // positions the last round drafted
    auto_stats                            stats_;
    std::vector<int32_t>                  ring_rows_, positions_;  // after_verify's context rows
};

}  // namespace pdf
