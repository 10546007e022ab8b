#include "decode/verifier.h"
#include "core/clock.h"
#include "core/error.h"

namespace pdf {

void greedy_verifier::walk(const draft_tree & t, const session & s, std::vector<int> & rows, int32_t & bonus,
                           std::vector<float> & accept_prob) {
    const std::vector<int32_t> & argmax = s.argmax();
    int32_t                      picked = -1;
    walk_target(
        t, [&](int node) { return picked = argmax[node]; },
        [&](int32_t token) { return token == picked ? 1.0 : 0.0; }, rows, bonus, accept_prob);
}

sampling_verifier::sampling_verifier(const sampling_params & params, int64_t n_vocab, int n_ctx,
                                     const std::vector<int32_t> & prompt)
    : sampler_(params, n_vocab, n_ctx) {
    sampler_.set_history(prompt.data(), (int) prompt.size());
}

int32_t sampling_verifier::draw(const std::function<const float *()> & row) {
    const auto       t0         = clock_type::now();
    token_constraint * constraint = sampler_.params().constraint.get();
    const int32_t      token      = sampler_.sample(row(), t_++, constraint ? constraint->allowed() : nullptr);
    sampler_.accept(token);  // every chosen token is committed: the history of the next draw
    if (constraint) {
        constraint->accept(token);
    }
    if (sampler_.params().n_logprobs >= 0) {
        chosen_.push_back(sampler_.logprobs());
    }
    choose_ms_ += ms_since(t0);
    return token;
}

int32_t sampling_verifier::first(const session::prefill_marks & m) {
    if (m.next_logits.empty()) {
        throw error("sampling: the prompt's last logits were not kept");
    }
    chosen_.clear();
    return draw([&] { return m.next_logits.data(); });
}

void sampling_verifier::walk(const draft_tree & t, const session & s, std::vector<int> & rows, int32_t & bonus,
                             std::vector<float> & accept_prob) {
    chosen_.clear();
    walk_target(
        t, [&](int node) { return draw([&] { return s.logits_row(node); }); },
        [&](int32_t token) { return sampler_.probability(token); }, rows, bonus, accept_prob);
}

std::unique_ptr<verifier> make_verifier(const sampling_params & params, int64_t n_vocab, int n_ctx,
                                        const std::vector<int32_t> & prompt) {
    if (!params.needs_logits()) {
        params.validate(n_vocab);
        return std::make_unique<greedy_verifier>();
    }
    return std::make_unique<sampling_verifier>(params, n_vocab, n_ctx, prompt);
}

}  // namespace pdf
