#include "decode/driver.h"
#include "core/clock.h"
#include "core/error.h"
#include "decode/verifier.h"

#include <algorithm>

namespace pdf {

// How much of the session's prompt cache (session::prefill_marks) `prompt` continues from: all of it when it
// is the last prompt again, else the whole micro-batches it shares with the last prompt (a hybrid model only
// from the mark, where its recurrent state was kept), leaving at least one token to evaluate.
static int reusable_prefix(const session & s, const std::vector<int32_t> & prompt) {
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

bool prefill(session & s, proposer & p, const std::vector<int32_t> & prompt, generate_timings & t) {
    if (prompt.empty()) {
        throw std::invalid_argument("prompt is empty");
    }
    if (prompt.size() > s.n_ctx()) {
        throw context_overflow_error(format("prompt has %zu tokens but n_ctx = %u", prompt.size(), s.n_ctx()),
                                     (long long) prompt.size(), s.n_ctx());
    }
    const int L     = (int) prompt.size();
    const int ub    = (int) s.n_ubatch();
    const int reuse = p.before_prefill(reusable_prefix(s, prompt));
    s.resume_prefill(reuse);
    t.cached_n = reuse;
    t.prompt_n = L - reuse;
    if (reuse == L) {
        t.prompt_ms = 0.0;
        return true;
    }
    s.begin_prefill(prompt, reuse);

    // micro-batches at multiples of n_ubatch, whatever was reused: the rows (and the last logits) come out the
    // same as a prefill from an empty cache
    const auto t0 = clock_type::now();
    for (int i = reuse; i < L; i += ub) {
        const int                   n = std::min(ub, L - i);
        const compute_backends::step step(*s.compute());  // the drafter's append in the same step
        p.before_eval(i, n);
        // the last row's logits stay on the device unless read (the last micro-batch's: a sampled first token)
        batch_layout whole;
        whole.whole = true;  // committed whole: a hybrid target keeps no per-token states
        s.eval(prompt.data() + i, n, whole, read_logits_last, p.capture(), p.ring());
        s.commit(n);
        p.after_prefill_chunk(i, n);
        if (n == ub && i + n == L / ub * ub) {
            s.mark_aligned(i + n);  // the last whole micro-batch
        }
        if (s.abort.load()) {
            t.prompt_ms = ms_since(t0);
            return false;
        }
    }
    const float * last = s.logits_row(0);
    s.mark_whole(s.argmax().back(), std::vector<float>(last, last + s.model().info().n_vocab));
    t.prompt_ms = ms_since(t0);
    return true;
}

std::vector<double> time_prefill_microbatches(session & s, proposer & p, const std::vector<int32_t> & tokens,
                                              const std::vector<int> & sizes, int reps) {
    std::vector<double> ms_per_token;
    for (int n : sizes) {
        if (n <= 0 || n > (int) tokens.size() || n > (int) s.n_ctx()) {
            throw std::invalid_argument(format("time_prefill_microbatches: size %d needs %d tokens (%zu given) and "
                                               "n_ctx >= %d (%u)", n, n, tokens.size(), n, s.n_ctx()));
        }
    }
    p.before_prefill(0);  // the drafter forgets its context too
    for (int n : sizes) {
        batch_layout whole;
        whole.whole = true;
        double best = 1e30;
        for (int r = 0; r <= reps; ++r) {
            s.truncate(0);
            p.before_eval(0, n);
            const auto t0 = clock_type::now();
            s.eval(tokens.data(), n, whole, read_logits_last, p.capture(), p.ring());
            if (r > 0) {
                best = std::min(best, ms_since(t0));
            }
        }
        ms_per_token.push_back(best / n);
    }
    s.truncate(0);
    s.compute()->pause();
    return ms_per_token;
}

namespace {

// The time of a round's parts, less what this session waited meanwhile for its share of the model's CPU threads
// (other sessions computing, core/backend.h): what the round costs on its share is what auto weighs
class round_clock {
  public:
    explicit round_clock(const compute_backends & compute) : compute_(compute) {}
    void   start() { t0_ = clock_type::now(), waited0_ = compute_.waited_ms(); }
    double ms() const { return ms_since(t0_) - (compute_.waited_ms() - waited0_); }

  private:
    const compute_backends & compute_;
    clock_type::time_point   t0_;
    double                   waited0_ = 0.0;
};

// what one round proposes, verifies and commits; kept across rounds (no allocation per round)
struct round_state {
    draft_tree           tree;
    std::vector<int>     rows;         // the accepted path's tree nodes, root first
    std::vector<float>   accept_prob;  // per node (verifier::walk)
    std::vector<int32_t> committed;    // the accepted drafts and the target's bonus token
};

bool is_stop(const generate_params & params, int32_t tok) {
    return std::find(params.stop_tokens.begin(), params.stop_tokens.end(), tok) != params.stop_tokens.end();
}

// hands a round's committed tokens to the caller, up to a stop token or max_tokens; false: generation ends
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
        return false;
    }
    return (int) r.tokens.size() < params.max_tokens;
}

// a speculative round's statistics: what it commits to the output, up to and including a stop token
void count_round(const round_state & round, double verify_ms, const generate_params & params, generate_timings & t) {
    const int n       = round.tree.size();
    int       counted = 0;
    while (counted + 1 < (int) round.rows.size() && !is_stop(params, round.committed[counted])) {
        ++counted;
    }
    t.n_rounds++;
    t.verify_n += n;
    t.verify_ms += verify_ms;
    t.draft_n += n - 1;
    t.draft_n_accepted += counted;
    const int depth = round.tree.max_depth();
    for (int k = 0; k < depth; ++k) {
        t.proposed_at[k]++;
        t.accepted_at[k] += k < counted;
    }
}

// One round from `anchor` at position `start`: propose at most max_depth drafts deep and max_nodes nodes, verify
// them in one target evaluation, walk down it, report the round's costs, commit the accepted path (KV rows
// compacted, the recurrent state of the last accepted node, no replay). Returns the bonus token.
int32_t run_round(session & s, proposer & p, verifier & choose, int32_t anchor, int start, int max_depth,
                  int max_nodes, const generate_params & params, round_state & round, generate_timings & t) {
    // a plain decoding step (no drafter) on a fair share of the model's CPU threads, a speculative round on all
    // of them (core/backend.h); a wait for them is not in the round's time
    const compute_backends::step step(*s.compute(), p.max_depth() == 0);
    round_clock                  whole(*s.compute()), part(*s.compute());
    whole.start();
    p.propose(anchor, start, max_depth, max_nodes, round.tree);
    const double draft_ms = p.drafted() ? whole.ms() : 0.0;
    t.draft_ms += draft_ms;

    const draft_tree & tree = round.tree;
    const int          n    = tree.size();
    p.before_eval(start, n);
    batch_layout layout;
    layout.parents = tree.is_chain() ? nullptr : tree.parents.data();
    part.start();
    s.eval(tree.tokens.data(), n, layout, read_logits_all, p.capture(), p.ring());
    t.n_target_evals++;
    int32_t bonus = 0;
    choose.walk(tree, s, round.rows, bonus, round.accept_prob);
    const double verify_ms = part.ms();  // sampling included: it is part of each step's cost
    if (cost_model * costs = p.costs()) {
        costs->observe({n, s.is_recurrent() && !tree.is_chain(), verify_ms, p.drafted(), draft_ms,
                        (int) round.rows.size(), whole.ms()});
    }
    p.after_verify(s, tree, start, round.rows, round.accept_prob);
    s.commit(round.rows);

    round.committed.clear();
    for (size_t i = 1; i < round.rows.size(); ++i) {
        round.committed.push_back(tree.tokens[round.rows[i]]);
    }
    round.committed.push_back(bonus);
    if (p.speculative_round()) {
        count_round(round, verify_ms, params, t);
    }
    return bonus;
}

}  // namespace

generate_result generate(session & s, proposer & p, const std::vector<int32_t> & prompt,
                         const generate_params & params, const token_callback & on_tokens) {
    generate_result    r;
    generate_timings & t = r.timings;
    s.abort.store(false);
    struct pause_when_done {  // also when an exception leaves
        const compute_backends & compute;
        ~pause_when_done() { compute.pause(); }
    } pause_workers{*s.compute()};
    const compute_backends::generation busy(*s.compute());  // the model's threads are shared among busy sessions
    if (p.ring() && (int) s.n_ubatch() > p.ring()->capacity()) {
        throw std::invalid_argument(format("n_ubatch = %u exceeds the feature ring's %d rows", s.n_ubatch(),
                                           p.ring()->capacity()));
    }
    const std::unique_ptr<verifier> choose = make_verifier(params.sampling, s.model().info().n_vocab,
                                                           (int) s.n_ctx(), prompt);
    r.finish_reason = "length";
    if (!prefill(s, p, prompt, t) || s.abort.load()) {
        r.finish_reason = "abort";
        return r;
    }
    int32_t    anchor = choose->first(s.prefill_cache());  // the first generated token, at position start
    int        start  = s.n_past();
    const auto t0     = clock_type::now();

    round_state round;
    t.proposed_at.assign(p.max_depth(), 0);
    t.accepted_at.assign(p.max_depth(), 0);
    round.committed.assign(1, anchor);
    bool go = params.max_tokens > 0 && emit(round.committed, *choose, params, on_tokens, r);
    while (go) {
        if (s.abort.load()) {
            r.finish_reason = "abort";
            break;
        }
        const int room = (int) s.n_ctx() - start;
        if (room <= 0) {
            break;  // context full: "length"
        }
        // a path commits its drafts and the target's bonus token: at most max_tokens - produced of them
        const int remaining = params.max_tokens - (int) r.tokens.size();
        anchor = run_round(s, p, *choose, anchor, start, remaining - 1, std::min<int>(room, (int) s.n_rollback()),
                           params, round, t);
        start += (int) round.rows.size();
        go = emit(round.committed, *choose, params, on_tokens, r);
    }
    t.predicted_n  = (int) r.tokens.size();
    t.predicted_ms = ms_since(t0);
    t.sample_ms    = choose->choose_ms();
    return r;
}

}  // namespace pdf
