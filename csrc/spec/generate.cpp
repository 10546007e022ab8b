#include "spec/generate.h"
#include "core/error.h"

#include <algorithm>
#include <chrono>

namespace pdf {

using clock_type = std::chrono::steady_clock;

static double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

void prefill(session & s, const std::vector<int32_t> & prompt, uint32_t n_ubatch, generate_timings & t) {
    if (prompt.empty()) {
        throw std::invalid_argument("prompt is empty");
    }
    if (prompt.size() > s.n_ctx()) {
        throw context_overflow_error(format("prompt has %zu tokens but n_ctx = %u", prompt.size(), s.n_ctx()),
                                     (long long) prompt.size(), s.n_ctx());
    }
    // reuse the cached prefix, but always evaluate at least the last prompt token (its logits are needed)
    const std::vector<int32_t> & cached = s.tokens();
    size_t common = 0;
    while (common < cached.size() && common + 1 < prompt.size() && cached[common] == prompt[common]) {
        ++common;
    }
    if (s.is_recurrent() && common < cached.size()) {
        common = 0;  // a recurrent state can only be continued, not cut back
    }
    s.truncate((int) common);
    t.cached_n = (int) common;

    const auto t0 = clock_type::now();
    for (size_t i = common; i < prompt.size(); i += n_ubatch) {
        const int n = (int) std::min<size_t>(n_ubatch, prompt.size() - i);
        s.eval(prompt.data() + i, nullptr, n, nullptr, LOGITS_NONE);
        s.commit(n);
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

}  // namespace pdf
