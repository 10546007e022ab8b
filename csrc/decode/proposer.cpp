#include "decode/proposer.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>

namespace pdf {

// auto: after a round whose running speculative rate fell below plain decoding's by this fraction, decode
// plainly for a cool-down that doubles each time speculation fails again (a probe round ends each one, judged
// on its own rate). At most one probe per COOLDOWN_MAX plain tokens: on a model too small to gain anything a
// probe (a draft and a verify after a long pause, their graphs rebuilt for the grown context) costs about 20
// of its steps, ~1% of the 2048.
static constexpr double SLOWER_THAN_PLAIN = 0.02;
static constexpr double CLEARLY_FASTER    = 0.05;
static constexpr double FAR_BEHIND        = 0.7;
static constexpr int    COOLDOWN_MIN      = 4;
static constexpr int    COOLDOWN_MAX      = 2048;
static constexpr int    PROBE_ROUNDS      = 3;
// the most nodes auto verifies as a tree while no chain as wide has been measured (best_verify_cut)
static constexpr int    UNMEASURED_TREE_NODES = 8;
// A cool-down's plain rounds capture the drafter's features only in the last FEATURE_LEAD of them; the positions
// before are skipped (draft_session::skip), which saves the capture in every plain step (1-2% of a step on the
// tiny MoE pairs) and appending those rows to the drafter's cache. The next draft reads the prompt's rows and
// these; measured on the trained pairs (20 prompts, blocks drafted after skipping every generated position but
// the last L), the accepted length against a whole context: qwen3 L = 64 0.90x, 128 0.96x, 256 0.97x; qwen35
// and qwen3moe (the prompt skipped too) 0.97-1.06x from L = 64.
static constexpr int    FEATURE_LEAD      = 256;
// auto alone on the CPU drafts as deep as it is likely to verify: twice the depth its last cut kept (at least
// MIN_DRAFT_DEPTH, rounded up to a block of a power of two, so that a few graphs serve every length). A DFlash
// draft's time grows with its positions (the tiny MoE pairs: 0.23-0.30 ms for a block of 4, 1.0 ms for 16, a
// plain step 0.2), and the positions past the cut are never verified. Acceptance at a position does not fall
// with a shorter block (trained pairs, chains of blocks 4, 8 and 16 cut at the same depth: the same or higher).
// Where the target takes rows in tiles (decode/cost_model.h) a block holds at least two of them: one tile alone is
// a dear verify (the qwen35 q8_0 target at width 768: 4 rows 3.7 plain steps, 8 rows 4.1), and a block of 4 that
// offered only the root or one tile was declined round after round, its cut of depth 0 keeping the next block at
// 4 (DFlash2 drafter, 8 code prompts x 96 tokens: 143-147 tok/s, at least two tiles 169-172; q4mix 269 / 283-286,
// with the DFlash drafter q8_0 115 / 128).
static constexpr int    MIN_DRAFT_DEPTH   = 3;

dflash_proposer::dflash_proposer(draft_session & d, speculation_state & state, const spec_params & params,
                                 bool recurrent_target)
    : d_(d), state_(state), costs_(state.costs), acceptance_(state.acceptance), params_(params),
      recurrent_(recurrent_target) {}

int dflash_proposer::before_prefill(int reusable) {
    // a reused prefix already has its rows in the draft cache, unless plain decoding extended it
    d_.truncate(reusable);
    if (d_.n_valid() < reusable) {
        d_.truncate(0);
        return 0;
    }
    return reusable;
}

void dflash_proposer::after_prefill_chunk(int first, int n) {
    d_.queue_positions(first, n);  // appended by the next draft, or before an evaluation overwrites them
}

bool dflash_proposer::draft_candidates(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) {
    drafted_ = false;
    out.reset(anchor);
    if (std::min({max_depth, d_.block() - 1, max_nodes - 1}) <= 0) {
        return false;
    }
    if (sits_out_round(state_, batch())) {
        stats_.n_skipped++;
        // (beside other generations the batch's cool-down counts, and its steps evaluate them together)
        captures_ = !(judges_itself(batch()) && state_.cooldown >= FEATURE_LEAD);
        return false;
    }
    // (beside other generations every draft covers the whole block: drafts of one length share the batch's
    // drafter graph; so it does on a GPU, where a few positions more cost next to nothing and each block length
    // would be a drafter graph to capture)
    int block = 0;  // (0: the whole block)
    if (judges_itself(batch()) && !costs_.grid_widths()) {
        block = 2;  // the smallest block of a power of two that holds the anchor and the depth wanted
        const int least = std::max(MIN_DRAFT_DEPTH, 2 * costs_.row_tile() - 1);
        while (block < std::max(state_.draft_depth, least) + 1) {
            block *= 2;
        }
    }
    return candidates(anchor, start, max_depth, max_nodes, out, block - 1);
}

bool dflash_proposer::candidates(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out,
                                 int depth) {
    out.reset(anchor);
    max_depth = std::min({max_depth, d_.block() - 1, max_nodes - 1, depth > 0 ? depth : max_depth});
    drafted_       = max_depth > 0;
    drafted_depth_ = max_depth;
    if (!drafted_) {
        return false;
    }
    const draft_proposals & p = draft_block(d_, anchor, start, max_depth + 1);
    if (costs_.grid_widths()) {
        // on a GPU auto verifies chains (decode/cost_model.h, verifiable)
        build_draft_chain(p, anchor, max_depth, out);
        return true;
    }
    learnt_scores(p, acceptance_, scores_);
    build_draft_tree(p, anchor, node_limit(max_nodes), max_depth, tree_seed::best_first, out, &scores_);
    return true;
}

bool sits_out_round(speculation_state & state, const eval_batcher * batch) {
    // auto decodes plainly through a cool-down, and until it knows what a plain step costs (a fresh process: the
    // first round)
    if (batch && batch->shared() && state.costs.knows_plain_step()) {
        return batch->sits_out();  // the batch's cool-down, not its own
    }
    if (state.cooldown > 0 || !state.costs.knows_plain_step()) {
        state.cooldown = std::max(0, state.cooldown - 1);
        return true;
    }
    return false;
}

bool judges_itself(const eval_batcher * batch) {
    return !(batch && batch->shared());
}

int tree_node_limit(int max_nodes, const cost_model & costs, int tree_budget) {
    const int limit = std::min(max_nodes, costs.max_width()) - 1;
    return tree_budget > 0 ? std::min(limit, tree_budget) : limit;
}

void learnt_scores(const draft_proposals & p, const acceptance_model & acceptance, std::vector<float> & scores) {
    scores.resize((size_t) p.n_positions * p.top_k);
    for (int pos = 0; pos < p.n_positions; ++pos) {
        for (int r = 0; r < p.top_k; ++r) {
            const double a  = acceptance.p_accept(pos + 1, r, std::exp((double) p.logprob(pos, r)));
            float &      sc = scores[(size_t) pos * p.top_k + r];
            sc              = (float) std::log(std::max(a, 1e-9));
            if (r > 0) {
                sc = std::min(sc, scores[(size_t) pos * p.top_k + r - 1]);  // non-increasing in rank
            }
        }
    }
}

void learn_from_verify(acceptance_model & acceptance, const draft_tree & t, const std::vector<float> & accept_prob) {
    // every node whose parent the target accepted was tried; what counts is the probability that the target chose
    // it there (greedy: 0 or 1; sampling: the sampler's probability, which the draw only estimates)
    for (int b = 1; b < t.size(); ++b) {
        if (accept_prob[b] >= 0.0f) {
            acceptance.observe(t.depth[b], t.rank[b], std::exp((double) t.logp[b]), accept_prob[b]);
        }
    }
}

double dflash_proposer::p_accept(const draft_tree & t, int b) const {
    return acceptance_.p_accept(t.depth[b], t.rank[b], std::exp((double) t.logp[b]));
}

void dflash_proposer::propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) {
    speculative_ = params_.mode != spec_mode::automatic;
    captures_    = true;
    if (params_.mode == spec_mode::automatic) {
        if (draft_candidates(anchor, start, max_depth, max_nodes, full_)) {
            const int b = verify_budget(full_, costs_, acceptance_, recurrent_);
            full_.truncate(1 + b);
            state_.draft_depth = 2 * full_.max_depth();
            speculative_ = b > 0;
            (b == 0 ? stats_.n_plain : full_.is_chain() ? stats_.n_chain : stats_.n_tree)++;
        }
        out = full_;
        return;
    }
    drafted_ = false;
    out.reset(anchor);
    max_depth = std::min({max_depth, d_.block() - 1, max_nodes - 1});
    if (max_depth <= 0) {
        return;
    }
    const draft_proposals & p = draft_block(d_, anchor, start, max_depth + 1);
    drafted_                  = true;
    drafted_depth_            = max_depth;
    if (params_.mode == spec_mode::chain) {
        build_draft_chain(p, anchor, max_depth, out);
    } else {
        build_draft_tree(p, anchor, node_limit(max_nodes), max_depth, params_.seed, out);
    }
}

int dflash_proposer::node_limit(int max_nodes) {
    // within the feature ring's rows too
    return tree_node_limit(std::min(max_nodes, d_.ring().capacity()), costs_, params_.tree_budget);
}

static std::vector<double> learnt_p_accept(const draft_tree & full, const acceptance_model & acceptance) {
    std::vector<double> p(full.size(), 1.0);
    for (int b = 1; b < full.size(); ++b) {
        p[b] = acceptance.p_accept(full.depth[b], full.rank[b], std::exp((double) full.logp[b]));
    }
    return p;
}

int choose_verify_budget(const draft_tree & full, const cost_model & costs, const acceptance_model & acceptance,
                         bool recurrent_target) {
    return choose_verify_budget(full, learnt_p_accept(full, acceptance), costs, recurrent_target);
}

int proposer::verify_budget(const draft_tree & full, const std::vector<double> & p_accept, const cost_model & costs,
                            bool recurrent_target) {
    if (batch_ && full.size() > 1) {
        std::vector<double> reach(full.size(), 1.0), gains;  // P(the accepted path reaches node b)
        for (int b = 1; b < full.size(); ++b) {
            reach[b] = reach[full.parents[b]] * p_accept[b];
            gains.push_back(reach[b]);
        }
        const int planned = batch_->plan(gains);
        if (planned >= 0) {
            return planned;
        }
    }
    return choose_verify_budget(full, p_accept, costs, recurrent_target);
}

int proposer::verify_budget(const draft_tree & full, const cost_model & costs, const acceptance_model & acceptance,
                            bool recurrent_target) {
    return verify_budget(full, learnt_p_accept(full, acceptance), costs, recurrent_target);
}

int choose_verify_budget(const draft_tree & full, const std::vector<double> & p_accept, const cost_model & costs,
                         bool recurrent_target) {
    return best_verify_cut(full, p_accept, costs, recurrent_target).nodes;
}

// the best achievable rate (tokens per ms): what a verify's time would have produced elsewhere
static double best_rate(const cost_model & costs) {
    return std::max(costs.plain_rate(), costs.spec_rate());
}

verify_cut best_verify_cut(const draft_tree & full, const std::vector<double> & p_accept, const cost_model & costs,
                           bool recurrent_target) {
    // widths not measured yet cost, optimistically, what the widest measured one does (decode/cost_model.h): a
    // round that chooses one measures it
    const int           n_max = full.size();
    const double        rate  = best_rate(costs);
    verify_cut          best{0, 1.0 - rate * costs.verify_ms(1, false)};
    std::vector<double> reach(full.size(), 1.0);  // P(the accepted path reaches node i)
    double              expected = 0.0;
    bool                chain    = true;
    // A tree no wider than the widest chain measured (or UNMEASURED_TREE_NODES): past it a tree's time is a guess
    // on a guess (the chain's time there, itself extrapolated, in the ratio measured at the widest tree). On the
    // CPU those guesses ran low (qwen35 q4mix at width 768: 32 nodes guessed at 42 ms, measured 52; qwen35moe: 30
    // nodes guessed at 114, measured 150), and fresh processes verified trees of 24-32 nodes at 1.5-1.8x a chain
    // of 16's time for no more tokens (7.4-10.9 a round against 9.9-10.8). A drafter's chains reach its block, so
    // its trees do as well.
    const int           tree_limit = std::max(UNMEASURED_TREE_NODES, costs.widest_measured_chain());
    for (int b = 1; b < n_max; ++b) {
        reach[b] = reach[full.parents[b]] * p_accept[b];
        expected += reach[b];
        chain             = chain && full.parents[b] == b - 1;
        if (!chain && 1 + b > tree_limit) {
            break;
        }
        if (!costs.verifiable(1 + b, n_max)) {
            continue;
        }
        const double gain = 1.0 + expected - rate * costs.verify_ms(1 + b, recurrent_target && !chain);
        if (gain > best.gain) {
            best = {b, gain};
        }
    }
    return best;
}

bool worth_drafting_on(const draft_tree & chain, const std::vector<double> & p_accept, const cost_model & costs,
                       double step_ms, int max_more) {
    const int n = chain.size();
    if (max_more <= 0) {
        return false;
    }
    if (n < 2) {
        return true;  // nothing drafted yet to judge by
    }
    const double rate  = best_rate(costs);
    const double now   = best_verify_cut(chain, p_accept, costs, false).gain;
    double       reach = 1.0, expected = 0.0;
    for (int b = 1; b < n; ++b) {
        reach *= p_accept[b];
        expected += reach;
    }
    // each draft further on reached as often, given its parent, as the newest one was
    const double q = p_accept[n - 1];
    for (int j = 1; j <= max_more; ++j) {
        reach *= q;
        expected += reach;
        if (!costs.verifiable(n + j, n + max_more)) {
            continue;
        }
        if (1.0 + expected - rate * (costs.verify_ms(n + j, false) + j * step_ms) > now) {
            return true;
        }
    }
    return false;
}

void dflash_proposer::queue_context(const session & s, int start, const std::vector<int> & rows) {
    // the accepted nodes' features (written by the verify at their evaluation slots) become context rows
    const int m = (int) rows.size();
    ring_rows_.resize(m);
    positions_.resize(m);
    for (int i = 0; i < m; ++i) {
        ring_rows_[i] = d_.ring().slot(start + s.eval_slot(rows[i]));
        positions_[i] = start + i;
    }
    d_.queue(ring_rows_.data(), positions_.data(), m);
}

void dflash_proposer::learn(int depth, int rank, float logp, double accepted) {
    acceptance_.observe(depth, rank, std::exp((double) logp), accepted);
}

void dflash_proposer::judge_round() {
    if (params_.mode == spec_mode::automatic && judges_itself(batch())) {
        judge_speculation(state_);
    }
}

void judge_speculation(speculation_state & state) {
    // judged on the round's whole time (decode/driver.cpp), host work (tree building, the choice, the walk)
    // included: on a small model it is a fair part of a step
    cost_model & costs = state.costs;
    if (!costs.rated_last_round()) {
        return;
    }
    // A fresh run of speculation (a probe after a cool-down) is judged on its first PROBE_ROUNDS rounds together,
    // and on them alone: what set off the cool-down is stale, and one round is a noisy witness (it commits 1 to
    // 16 tokens by where in the text it falls). Judged on its first round, blended with the stretch before, one
    // probe at a hard spot (16 rows verified, 2 tokens committed: 0.35x plain, far behind) grew the cool-down
    // 8x, the next probe fell in the same stretch, and on the qwen35 q4mix target at width 768 with its DFlash2
    // drafter auto decoded 95 tokens of 96 plainly, prompt after prompt, where speculation ran at 1.6x plain
    // (bench_tree: 275 rounds in cool-downs of 374; judged on three, 4 runs each alternating, 274-292 tok/s
    // against 258-291, skipped rounds 4-12 against 4-156). Nor does a stale cool-down outlive a probe that wins:
    // one of 1024 set off by one hard prompt stayed for every later prompt, kept across processes.
    if (costs.last_round_fresh()) {
        state.probe_left   = PROBE_ROUNDS;
        state.probe_tokens = state.probe_ms = 0.0;
    }
    if (state.probe_left > 0) {
        state.probe_tokens += costs.last_round_rate() * costs.last_round_ms();
        state.probe_ms += costs.last_round_ms();
        if (--state.probe_left > 0) {
            return;
        }
        costs.set_spec_round(state.probe_tokens / PROBE_ROUNDS, state.probe_ms / PROBE_ROUNDS);
    }
    if (costs.spec_rate() < (1.0 - SLOWER_THAN_PLAIN) * costs.plain_rate()) {
        // the next cool-down doubles, or grows 8x when speculation runs far behind (a model too small for it)
        const int growth = costs.spec_rate() < FAR_BEHIND * costs.plain_rate() ? 8 : 2;
        state.cooldown   = std::max(state.cool_len, COOLDOWN_MIN);
        state.cool_len   = std::min(growth * state.cooldown, COOLDOWN_MAX);
    } else if (costs.spec_rate() > (1.0 + CLEARLY_FASTER) * costs.plain_rate()) {
        state.cool_len = COOLDOWN_MIN;  // only a clear win forgets the failures before it
    }
}

void dflash_proposer::after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                                   const std::vector<float> & accept_prob) {
    if (!captures_) {
        d_.skip(start, (int) rows.size());
        return;
    }
    queue_context(s, start, rows);
    if (!drafted_) {
        return;
    }
    learn_from_verify(acceptance_, t, accept_prob);
    judge_round();
}

}  // namespace pdf
