#include "decode/stream.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/graph_cache.h"
#include "decode/round_trace.h"

#include <algorithm>

namespace pdf {

// what one round proposes, verifies and commits; kept across rounds (no allocation per round)
struct generation_stream::round_state {
    draft_tree             tree;
    std::vector<int>       rows;         // the accepted path's tree nodes, root first
    std::vector<float>     accept_prob;  // per node (verifier::walk)
    std::vector<int32_t>   committed;    // the accepted drafts and the target's bonus token
    double                 propose_ms = 0.0;  // the proposer's choice and drafting
    double                 draft_ms   = 0.0;  // the same when it ran the drafter, else 0
    bool                   captures   = true;  // its evaluation captures the proposer's features
    graph_counts           graphs_before;     // traced rounds (decode/round_trace.h): the counts before the verify
};

namespace {

// How much of the session's prompt cache (session::prefill_marks) `prompt` continues from: all of it when it
// is the last prompt again, else the whole micro-batches it shares with the last prompt (a hybrid model only
// from the mark, where its recurrent state was kept), leaving at least one token to evaluate.
int reusable_prefix(const session & s, const std::vector<int32_t> & prompt) {
    const session::prefill_marks & m  = s.prefill_cache();
    const int                      L  = (int) prompt.size();
    const int                      ub = (int) s.n_ubatch();
    int shared = 0;
    while (shared < (int) m.prompt.size() && shared < L && m.prompt[shared] == prompt[shared]) {
        ++shared;
    }
    if (m.whole && shared == L && (int) m.prompt.size() == L) {
        return L;
    }
    const int reuse = std::min({m.aligned, shared / ub * ub, (L - 1) / ub * ub});
    return s.is_recurrent() && reuse != m.aligned ? 0 : reuse;
}

bool is_stop(const generate_params & params, int32_t tok) {
    return std::find(params.stop_tokens.begin(), params.stop_tokens.end(), tok) != params.stop_tokens.end();
}

// hands a round's committed tokens to the caller, up to a stop token or max_tokens; false: generation ends (with
// finish_reason set when it is not "length")
bool emit(const std::vector<int32_t> & batch, const verifier & choose, const generate_params & params,
          const token_callback & on_tokens, generate_result & r) {
    int n = 0;
    while (n < (int) batch.size() && !is_stop(params, batch[n]) && (int) r.tokens.size() + n < params.max_tokens) {
        ++n;
    }
    const bool stopped = n < (int) batch.size() && is_stop(params, batch[n]);
    r.tokens.insert(r.tokens.end(), batch.begin(), batch.begin() + n);
    const std::vector<token_logprobs> & lp = choose.chosen_logprobs();  // aligned with batch when asked for
    r.logprobs.insert(r.logprobs.end(), lp.begin(), lp.begin() + std::min<size_t>(n, lp.size()));
    const token_logprobs * batch_lp = lp.empty() ? nullptr : r.logprobs.data() + (r.logprobs.size() - n);
    if (n > 0 && on_tokens && !on_tokens(batch.data(), batch_lp, n)) {
        r.finish_reason = "abort";
        return false;
    }
    if (stopped) {
        r.finish_reason = "stop";
        r.stop_token    = batch[n];
        if ((size_t) n < lp.size()) {
            r.stop_logprobs = lp[n];
        }
        return false;
    }
    return (int) r.tokens.size() < params.max_tokens;
}

// a speculative round's statistics: what it commits to the output, up to and including a stop token
void count_round(const draft_tree & tree, const std::vector<int> & rows, const std::vector<int32_t> & committed,
                 double verify_ms, const generate_params & params, generate_timings & t) {
    const int n       = tree.size();
    int       counted = 0;
    while (counted + 1 < (int) rows.size() && !is_stop(params, committed[counted])) {
        ++counted;
    }
    t.n_rounds++;
    t.verify_n += n;
    t.verify_ms += verify_ms;
    t.draft_n += n - 1;
    t.draft_n_accepted += counted;
    const int depth = tree.max_depth();
    for (int k = 0; k < depth; ++k) {
        t.proposed_at[k]++;
        t.accepted_at[k] += k < counted;
    }
}

}  // namespace

generation_stream::generation_stream(session & s, proposer & p, const std::vector<int32_t> & prompt,
                                     const generate_params & params, const token_callback & on_tokens)
    : s_(s), p_(p), prompt_(prompt), params_(params), on_tokens_(on_tokens), round_(std::make_unique<round_state>()) {
    if (!p.rings().empty() && (int) s.n_ubatch() > p.rings().capacity()) {
        throw std::invalid_argument(format("n_ubatch = %u exceeds the feature ring's %d rows", s.n_ubatch(),
                                           p.rings().capacity()));
    }
    if (prompt.empty()) {
        throw std::invalid_argument("prompt is empty");
    }
    if (prompt.size() > s.n_ctx()) {
        throw context_overflow_error(format("prompt has %zu tokens but n_ctx = %u", prompt.size(), s.n_ctx()),
                                     (long long) prompt.size(), s.n_ctx());
    }
    choose_ = make_verifier(params.sampling, s.model().info().n_vocab, (int) s.n_ctx(), prompt);
    r_.finish_reason = "length";
}

generation_stream::~generation_stream() = default;

bool generation_stream::next(session_batch::part & out) {
    if (phase_ == phase::start) {
        start_prefill();
    }
    if (phase_ == phase::prefill) {
        const int ub = (int) s_.n_ubatch();
        chunk_n_     = std::min(ub, (int) prompt_.size() - next_chunk_);
        p_.before_eval(next_chunk_, chunk_n_);
        // committed whole: a hybrid target keeps no per-token states. The last row's logits stay on the device
        // unless read (the last micro-batch's: a sampled first token).
        out = {&s_, prompt_.data() + next_chunk_, chunk_n_, {}, read_logits_last, p_.capture(), p_.rings()};
        out.layout.whole = true;
        return true;
    }
    return phase_ == phase::decode && next_round(out);
}

void generation_stream::evaluated(double eval_ms) {
    if (phase_ == phase::prefill) {
        prefill_evaluated();
    } else {
        round_evaluated(eval_ms);
    }
}

void generation_stream::start_prefill() {
    const int L     = (int) prompt_.size();
    const int reuse = p_.before_prefill(reusable_prefix(s_, prompt_));
    s_.resume_prefill(reuse);
    r_.timings.cached_n = reuse;
    r_.timings.prompt_n = L - reuse;
    t0_                 = clock_type::now();
    if (reuse == L) {
        start_decoding();
        return;
    }
    // micro-batches at multiples of n_ubatch, whatever was reused: the rows (and the last logits) come out the
    // same as a prefill from an empty cache
    s_.begin_prefill(prompt_, reuse);
    next_chunk_ = reuse;
    phase_      = phase::prefill;
}

void generation_stream::prefill_evaluated() {
    const int ub = (int) s_.n_ubatch(), L = (int) prompt_.size(), i = next_chunk_, n = chunk_n_;
    s_.commit(n);
    p_.after_prefill_chunk(i, n);
    if (n == ub && i + n == L / ub * ub) {
        s_.mark_aligned(i + n);  // the last whole micro-batch
    }
    next_chunk_ += n;
    if (s_.abort.load()) {
        r_.timings.prompt_ms = ms_since(t0_);
        finish("abort");
    } else if (next_chunk_ == L) {
        const float * last = s_.logits_row(0);
        s_.mark_whole(s_.argmax().back(), std::vector<float>(last, last + s_.model().info().n_vocab));
        start_decoding();
    }
}

void generation_stream::start_decoding() {
    r_.timings.prompt_ms = r_.timings.cached_n == (int) prompt_.size() ? 0.0 : ms_since(t0_);
    if (s_.abort.load()) {
        finish("abort");
        return;
    }
    if (cost_model * costs = p_.costs()) {
        const int forced = cost_model::forced_grid_widths();
        costs->set_grid_widths(forced >= 0 ? forced == 1 : s_.computes_on_gpu());
        costs->set_row_tile(s_.model().verify_row_tile());
    }
    anchor_ = choose_->first(s_.prefill_cache());  // the first generated token, at position start_
    start_  = s_.n_past();
    t0_     = clock_type::now();
    r_.timings.proposed_at.assign(p_.max_depth(), 0);
    r_.timings.accepted_at.assign(p_.max_depth(), 0);
    round_->committed.assign(1, anchor_);
    phase_ = phase::decode;
    if (!(params_.max_tokens > 0 && emit(round_->committed, *choose_, params_, on_tokens_, r_))) {
        finish(nullptr);
    }
}

// how deep a round may draft with `remaining` tokens left to produce: remaining - 1 (its path commits its drafts
// and the bonus token). With grid widths (a GPU's, decode/cost_model.h) one less than a grid width, so that the
// last rounds of a generation verify graphs already captured rather than a width of their own each (an H200,
// the MoE pair: 2-3 such rounds per 96 tokens, each a graph built and run uncaptured, 6-9 ms against 2-4).
int generation_stream::depth_cap(int remaining) const {
    const cost_model * costs = p_.costs();
    if (!costs || !costs->grid_widths()) {
        return remaining - 1;
    }
    return std::min(costs->widest_verifiable(remaining), remaining) - 1;
}

// A round from anchor_ at position start_: the proposer drafts at most max_depth deep and max_nodes nodes; the
// caller verifies them in one target evaluation
bool generation_stream::next_round(session_batch::part & out) {
    if (s_.abort.load()) {
        finish("abort");
        return false;
    }
    const int room = (int) s_.n_ctx() - start_;
    if (room <= 0) {
        finish(nullptr);  // context full: "length"
        return false;
    }
    // a path commits its drafts and the target's bonus token: at most max_tokens - produced of them
    const int    remaining = params_.max_tokens - (int) r_.tokens.size();
    round_state & round     = *round_;
    const auto    t0        = clock_type::now();
    const double  waited0   = s_.compute()->waited_ms() + eval_batcher::waited_ms();
    p_.propose(anchor_, start_, depth_cap(remaining), std::min<int>(room, (int) s_.n_rollback()), round.tree);
    if (token_constraint * grammar = params_.sampling.constraint.get(); grammar && round.tree.size() > 1) {
        round.tree.truncate(allowed_prefix(round.tree, *grammar));
    }
    // without the waits for the CPU threads and for the batch's plan (batched: the other streams drafting),
    // which are not this drafter's cost: its own compute delays the batch's step, the waits do not
    const double waited = s_.compute()->waited_ms() + eval_batcher::waited_ms() - waited0;
    round.propose_ms    = std::max(0.0, ms_since(t0) - waited);
    round.draft_ms      = p_.drafted() ? round.propose_ms : 0.0;
    r_.timings.draft_ms += round.draft_ms;
    const int n    = round.tree.size();
    round.captures = p_.captures_round();
    if (round.captures) {
        p_.before_eval(start_, n);
    }
    out = {&s_, round.tree.tokens.data(), n, {}, read_logits_all,
           round.captures ? p_.capture() : std::vector<int>{}, round.captures ? p_.rings() : ring_set{}};
    out.layout.parents = round.tree.is_chain() ? nullptr : round.tree.parents.data();
    if (round_tracing()) {
        round.graphs_before = graph_counters();
    }
    return true;
}

// The walk down the verified tree, the round's costs reported, the accepted path committed (KV rows compacted,
// the recurrent state of the last accepted node, no replay) and emitted with the bonus token
void generation_stream::round_evaluated(double eval_ms) {
    round_state &      round = *round_;
    const draft_tree & tree  = round.tree;
    const int          n     = tree.size();
    generate_timings & t     = r_.timings;
    t.n_target_evals++;
    const auto walk_t0 = clock_type::now();
    int32_t    bonus   = 0;
    choose_->walk(tree, s_, round.rows, bonus, round.accept_prob);
    const double verify_ms = eval_ms + ms_since(walk_t0);  // sampling included: it is part of each step's cost
    if (cost_model * costs = p_.costs()) {
        costs->observe({n, s_.is_recurrent() && !tree.is_chain(), verify_ms, p_.drafted(), round.draft_ms,
                        (int) round.rows.size(), round.propose_ms + verify_ms, p_.learning(), p_.probing()});
    }
    if (round_tracing()) {
        const graph_counts now = graph_counters();
        trace_round({n, s_.is_recurrent() && !tree.is_chain(), p_.drafted(), p_.drafted_depth(), p_.drafted_models(),
                     round.captures, (int) round.rows.size(), round.draft_ms, verify_ms,
                     now.builds - round.graphs_before.builds, now.placements - round.graphs_before.placements});
    }
    p_.after_verify(s_, tree, start_, round.rows, round.accept_prob);
    s_.commit(round.rows);

    round.committed.clear();
    for (size_t i = 1; i < round.rows.size(); ++i) {
        round.committed.push_back(tree.tokens[round.rows[i]]);
    }
    round.committed.push_back(bonus);
    if (p_.speculative_round()) {
        count_round(tree, round.rows, round.committed, verify_ms, params_, t);
    }
    anchor_ = bonus;
    start_ += (int) round.rows.size();
    if (!emit(round.committed, *choose_, params_, on_tokens_, r_)) {
        finish(nullptr);
    }
}

void generation_stream::finish(const char * reason) {
    if (reason) {
        r_.finish_reason = reason;
    }
    if (phase_ == phase::decode) {
        r_.timings.predicted_n  = (int) r_.tokens.size();
        r_.timings.predicted_ms = ms_since(t0_);
        r_.timings.sample_ms    = choose_->choose_ms();
    }
    phase_ = phase::done;
}

}  // namespace pdf
