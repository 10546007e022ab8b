#include "decode/driver.h"
#include "core/clock.h"
#include "core/error.h"
#include "decode/stream.h"

#include <algorithm>
#include <optional>

namespace pdf {

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
            s.eval(tokens.data(), n, whole, read_logits_last, p.capture(), p.rings());
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

bool prefill(session & s, proposer & p, const std::vector<int32_t> & prompt, generate_timings & t) {
    generate_params no_tokens;
    no_tokens.max_tokens = 0;
    const generate_result r = generate(s, p, prompt, no_tokens, {});
    t                       = r.timings;
    return r.finish_reason != "abort";
}

generate_result generate(session & s, proposer & p, const std::vector<int32_t> & prompt,
                         const generate_params & params, const token_callback & on_tokens, eval_batcher * batcher) {
    s.abort.store(false);
    struct pause_when_done {  // also when an exception leaves
        const compute_backends & compute;
        ~pause_when_done() { compute.pause(); }
    } pause_workers{*s.compute()};
    const compute_backends::generation busy(*s.compute());  // the model's threads are shared among busy sessions
    std::optional<eval_batcher::member> joined;
    struct planned_by_batch {  // (also when an exception leaves)
        proposer & p;
        ~planned_by_batch() { p.plan_in(nullptr); }
    } planned{p};
    if (batcher) {
        joined.emplace(*batcher);
        p.plan_in(batcher);
    }
    generation_stream   stream(s, p, prompt, params, on_tokens);
    session_batch::part part;
    for (;;) {
        // Alone, one step on some of the model's CPU threads (core/backend.h): a prefill micro-batch or a
        // speculative round (drafting, the verify, the walk and the commit) on all of them, a plain decoding step
        // on a fair share; a wait for them is not in the step's time. Batched, each compute takes all of them in
        // turn: a generation waiting for the others' parts must not hold threads they need to draft.
        std::optional<compute_backends::step> step;
        if (!batcher) {
            step.emplace(*s.compute(), stream.decoding() && p.max_depth() == 0);
        }
        if (!stream.next(part)) {
            break;
        }
        if (batcher) {
            stream.evaluated(batcher->eval(part));
        } else {
            const auto t0 = clock_type::now();
            s.eval(part.tokens, part.n, part.layout, part.what, part.capture, part.rings);
            stream.evaluated(ms_since(t0));
        }
    }
    return std::move(stream.result());
}

}  // namespace pdf
