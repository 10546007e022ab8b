#include "spec/driver.h"
#include "core/clock.h"
#include "core/error.h"

#include <algorithm>

namespace pdf {

// the cached prefix a prompt can reuse; at least the last prompt token is always evaluated (its logits)
static size_t reusable_prefix(const session & s, const std::vector<int32_t> & prompt) {
    const std::vector<int32_t> & cached = s.tokens();
    size_t common = 0;
    while (common < cached.size() && common + 1 < prompt.size() && cached[common] == prompt[common]) {
        ++common;
    }
    return common;
}

void prefill(session & s, proposer & p, const std::vector<int32_t> & prompt, generate_timings & t) {
    if (prompt.empty()) {
        throw std::invalid_argument("prompt is empty");
    }
    if (prompt.size() > s.n_ctx()) {
        throw context_overflow_error(format("prompt has %zu tokens but n_ctx = %u", prompt.size(), s.n_ctx()),
                                     (long long) prompt.size(), s.n_ctx());
    }
    p.before_prefill(s, (int) reusable_prefix(s, prompt));
    size_t common = reusable_prefix(s, prompt);
    if (s.is_recurrent() && common < s.tokens().size()) {
        common = 0;  // a recurrent state can only be continued, not cut back
    }
    s.truncate((int) common);
    t.cached_n = (int) common;

    const auto t0 = clock_type::now();
    for (size_t i = common; i < prompt.size(); i += s.n_ubatch()) {
        const int n = (int) std::min<size_t>(s.n_ubatch(), prompt.size() - i);
        p.before_eval((int) i, n);
        s.eval(prompt.data() + i, n, {}, read_argmax_last, p.capture(), p.ring());
        s.commit(n);
        p.after_prefill_chunk((int) i, n);
        if (s.abort.load()) {
            break;
        }
    }
    t.prompt_n  = (int) (prompt.size() - common);
    t.prompt_ms = ms_since(t0);
}

generate_result generate(session & s, proposer & p, const std::vector<int32_t> & prompt,
                         const generate_params & params, const token_callback & on_tokens) {
    generate_result    r;
    generate_timings & t = r.timings;
    s.abort.store(false);
    if (p.ring() && (int) s.n_ubatch() > p.ring()->capacity()) {
        throw std::invalid_argument(format("n_ubatch = %u exceeds the feature ring's %d rows", s.n_ubatch(),
                                           p.ring()->capacity()));
    }
    prefill(s, p, prompt, t);
    r.finish_reason = "length";
    if (s.abort.load()) {
        r.finish_reason = "abort";
        return r;
    }

    int32_t anchor = s.argmax().back();  // the first generated token, at position start
    int     start  = s.n_past();
    if (params.max_tokens > 0) {
        t.warm_up_ms = p.warm_up(s, anchor);
    }
    const auto t0 = clock_type::now();

    auto is_stop = [&](int32_t tok) {
        return std::find(params.stop_tokens.begin(), params.stop_tokens.end(), tok) != params.stop_tokens.end();
    };
    // hand a round's committed tokens to the caller, up to a stop token or max_tokens; false: generation ends
    std::vector<int32_t> batch;
    auto emit = [&]() {
        int n = 0;
        while (n < (int) batch.size() && !is_stop(batch[n]) && (int) r.tokens.size() + n < params.max_tokens) {
            ++n;
        }
        const bool stopped = n < (int) batch.size() && is_stop(batch[n]);
        r.tokens.insert(r.tokens.end(), batch.begin(), batch.begin() + n);
        if (n > 0 && on_tokens && !on_tokens(batch.data(), n)) {
            r.finish_reason = "abort";
            return false;
        }
        if (stopped) {
            r.finish_reason = "stop";
            return false;
        }
        return (int) r.tokens.size() < params.max_tokens;
    };

    draft_tree       tree;
    std::vector<int> rows;
    t.proposed_at.assign(p.max_depth(), 0);
    t.accepted_at.assign(p.max_depth(), 0);
    batch.assign(1, anchor);
    bool go = params.max_tokens > 0 && emit();
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
        p.propose(anchor, start, remaining - 1, std::min<int>(room, (int) s.n_rollback()), tree);
        t.draft_ms += p.last_draft_ms();

        const int n = tree.size();
        p.before_eval(start, n);
        batch_layout layout;
        layout.parents = tree.is_chain() ? nullptr : tree.parents.data();
        auto t1 = clock_type::now();
        s.eval(tree.tokens.data(), n, layout, read_argmax_all, p.capture(), p.ring());
        const double verify_ms = ms_since(t1);
        t.n_target_evals++;

        int32_t bonus = 0;
        walk_greedy(tree, s.argmax().data(), rows, bonus);
        p.after_verify(s, tree, start, rows, verify_ms);
        s.commit(rows);  // KV rows compacted, recurrent state of the last accepted node, no replay

        batch.clear();
        for (size_t i = 1; i < rows.size(); ++i) {
            batch.push_back(tree.tokens[rows[i]]);
        }
        batch.push_back(bonus);
        if (p.speculative_round()) {
            // statistics count what the round commits to the output: up to and including a stop token
            int counted = 0;
            while (counted + 1 < (int) rows.size() && !is_stop(batch[counted])) {
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
        start += (int) rows.size();
        anchor = bonus;
        go     = emit();
    }
    t.predicted_n  = (int) r.tokens.size();
    t.predicted_ms = ms_since(t0);
    return r;
}

}  // namespace pdf
