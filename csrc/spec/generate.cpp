#include "spec/generate.h"
#include "state/draft_session.h"
#include "core/error.h"

#include <algorithm>
#include <chrono>

namespace pdf {

using clock_type = std::chrono::steady_clock;

static double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// the cached prefix a prompt can reuse; at least the last prompt token is always evaluated (its logits)
static size_t reusable_prefix(const session & s, const std::vector<int32_t> & prompt) {
    const std::vector<int32_t> & cached = s.tokens();
    size_t common = 0;
    while (common < cached.size() && common + 1 < prompt.size() && cached[common] == prompt[common]) {
        ++common;
    }
    return common;
}

void prefill(session & s, const std::vector<int32_t> & prompt, uint32_t n_ubatch, generate_timings & t,
             const std::vector<int> & capture_layers, feature_ring * ring,
             const std::function<void(int first, int n)> & on_chunk) {
    if (prompt.empty()) {
        throw std::invalid_argument("prompt is empty");
    }
    if (prompt.size() > s.n_ctx()) {
        throw context_overflow_error(format("prompt has %zu tokens but n_ctx = %u", prompt.size(), s.n_ctx()),
                                     (long long) prompt.size(), s.n_ctx());
    }
    size_t common = reusable_prefix(s, prompt);
    if (s.is_recurrent() && common < s.tokens().size()) {
        common = 0;  // a recurrent state can only be continued, not cut back
    }
    s.truncate((int) common);
    t.cached_n = (int) common;

    const auto t0 = clock_type::now();
    for (size_t i = common; i < prompt.size(); i += n_ubatch) {
        const int n = (int) std::min<size_t>(n_ubatch, prompt.size() - i);
        s.eval(prompt.data() + i, nullptr, n, nullptr, LOGITS_NONE, capture_layers, ring);
        s.commit(n);
        if (on_chunk) {
            on_chunk((int) i, n);
        }
        if (s.abort.load()) {
            break;
        }
    }
    t.prompt_n  = (int) (prompt.size() - common);
    t.prompt_ms = ms_since(t0);
}

generate_result generate_greedy(session & s, const std::vector<int32_t> & prompt, const generate_params & params,
                                const token_callback & on_tokens) {
    generate_result r;
    s.abort.store(false);
    prefill(s, prompt, s.n_ubatch(), r.timings);

    const auto t0 = clock_type::now();
    r.finish_reason = "length";
    int32_t next     = s.argmax().back();
    while ((int) r.tokens.size() < params.max_tokens) {
        if (s.abort.load()) {
            r.finish_reason = "abort";
            break;
        }
        if (std::find(params.stop_tokens.begin(), params.stop_tokens.end(), next) != params.stop_tokens.end()) {
            r.finish_reason = "stop";
            break;
        }
        r.tokens.push_back(next);
        if (on_tokens && !on_tokens(&next, 1)) {
            r.finish_reason = "abort";
            break;
        }
        if ((int) r.tokens.size() >= params.max_tokens) {
            break;
        }
        if ((uint32_t) s.n_past() >= s.n_ctx()) {
            break;  // context full: "length"
        }
        s.eval(&next, nullptr, 1, nullptr, LOGITS_NONE);
        s.commit(1);
        r.timings.n_target_evals++;
        next = s.argmax().back();
    }
    r.timings.predicted_n  = (int) r.tokens.size();
    r.timings.predicted_ms = ms_since(t0);
    return r;
}

generate_result generate_dflash(session & s, draft_session & d, const std::vector<int32_t> & prompt,
                                const generate_params & params, const token_callback & on_tokens) {
    const std::vector<int> & capture = d.model().capture_layers();
    feature_ring &           ring    = d.ring();
    generate_result          r;
    generate_timings &       t = r.timings;
    s.abort.store(false);

    if ((int) s.n_ubatch() > ring.capacity()) {
        throw std::invalid_argument(format("n_ubatch = %u exceeds the feature ring's %d rows", s.n_ubatch(),
                                           ring.capacity()));
    }
    // prefill: the target writes the draft's layers into the ring; the drafter projects every prompt row
    // once. A reused prefix already has its rows in the draft cache.
    const int common = (int) reusable_prefix(s, prompt);
    d.truncate(common);
    if (d.n_valid() < common) {
        s.truncate(0);  // the target's cached prefix has no drafter rows (e.g. after plain decoding)
    }
    std::vector<int32_t> pos;
    prefill(s, prompt, s.n_ubatch(), t, capture, &ring, [&](int first, int n) {
        pos.resize(n);
        for (int i = 0; i < n; ++i) {
            pos[i] = first + i;
        }
        d.append(pos.data(), n);
    });

    const auto t0     = clock_type::now();
    r.finish_reason   = "length";
    int32_t anchor    = s.argmax().back();  // the first generated token, at position start
    int     start     = s.n_past();
    int     new_rows  = 0;                  // context rows the next draft call appends (from the last verify)
    const int B       = d.block();
    t.accepted_at.assign(B - 1, 0);
    t.proposed_at.assign(B - 1, 0);
    std::vector<int32_t> block(B);

    auto is_stop = [&](int32_t tok) {
        return std::find(params.stop_tokens.begin(), params.stop_tokens.end(), tok) != params.stop_tokens.end();
    };
    // emit one committed token; false when generation ends here
    auto emit = [&](int32_t tok) {
        if (is_stop(tok)) {
            r.finish_reason = "stop";
            return false;
        }
        r.tokens.push_back(tok);
        if (on_tokens && !on_tokens(&tok, 1)) {
            r.finish_reason = "abort";
            return false;
        }
        return (int) r.tokens.size() < params.max_tokens;
    };

    if (params.max_tokens > 0 && emit(anchor)) {
        while (true) {
            if (s.abort.load()) {
                r.finish_reason = "abort";
                break;
            }
            const int room = (int) s.n_ctx() - start;
            if (room <= 0) {
                break;  // context full: "length"
            }
            // draft: [anchor, MASK x (nb-1)] -> proposals for start+1 .. start+nb-1. The last round drafts only
            // what max_tokens leaves room for (as the reference loops do: the drafter sees fewer masks).
            const int remaining = params.max_tokens - (int) r.tokens.size();  // >= 1
            const int nb        = std::min(B, remaining);
            auto      t1        = clock_type::now();
            const std::vector<int32_t> * proposals = nullptr;
            if (nb >= 2) {
                proposals = &d.draft(pos.data(), new_rows, anchor, start, nb);
            } else {
                d.append(pos.data(), new_rows);
            }
            t.draft_ms += ms_since(t1);

            // verify [anchor, proposals] in one target pass of the usual B rows (shorter only at the end of the
            // context); rows past the proposals are filler that is never accepted
            const int n = std::min(B, room);
            block[0] = anchor;
            for (int i = 1; i < n; ++i) {
                block[i] = proposals && i - 1 < (int) proposals->size() ? (*proposals)[i - 1] : anchor;
            }
            t1 = clock_type::now();
            s.eval(block.data(), nullptr, n, nullptr, ARGMAX_ALL, capture, &ring);
            t.verify_ms += ms_since(t1);
            t.n_target_evals++;
            t.n_rounds++;

            // accept the longest prefix the target agrees with, plus the target's own next token. The graph
            // keeps its B rows, but no more drafts are accepted than max_tokens leaves room for.
            const std::vector<int32_t> & target_next = s.argmax();
            const int n_useful = std::min(n, remaining);
            int a = 0;
            while (a < n_useful - 1 && block[a + 1] == target_next[a]) {
                ++a;
            }
            // statistics count what the round commits to the output: up to and including a stop token
            int counted = a;
            for (int i = 1; i <= a; ++i) {
                if (is_stop(block[i])) {
                    counted = i - 1;
                    break;
                }
            }
            t.draft_n += n_useful - 1;
            t.draft_n_accepted += counted;
            for (int k = 0; k < n_useful - 1; ++k) {
                t.proposed_at[k]++;
                t.accepted_at[k] += k < counted;
            }
            s.commit(a + 1);  // anchor + accepted drafts; KV and recurrent state as of token a, no replay

            // the committed rows' features (already in the ring) feed the drafter next round
            pos.resize(a + 1);
            for (int i = 0; i <= a; ++i) {
                pos[i] = start + i;
            }
            new_rows = a + 1;

            bool go = true;
            for (int i = 1; i <= a && go; ++i) {
                go = emit(block[i]);
            }
            anchor = target_next[a];
            start += a + 1;
            if (!go || !emit(anchor)) {
                break;
            }
        }
    }
    if (new_rows > 0) {
        d.append(pos.data(), new_rows);  // keep the drafter level with the target's cache
    }
    t.predicted_n  = (int) r.tokens.size();
    t.predicted_ms = ms_since(t0);
    return r;
}

}  // namespace pdf
