// Sampling a token from the target's logits: llama.cpp's default chain and llama-cpp-python's parameters.
//
// Stages, in llama.cpp's default order (common/sampling.cpp): logit bias -> penalties (repeat, frequency,
// presence over the last repeat_last_n tokens) -> top-k -> typical-p -> top-p -> min-p -> temperature -> draw.
// Each stage is off at its neutral value (top_k <= 0, typical_p >= 1, top_p >= 1, min_p <= 0). temperature <= 0
// takes the most likely remaining token (greedy, ties to the lower id); penalties and biases still apply.
//
// Lossless speculation rests on the draw. The draw for output position t takes its randomness from (seed, t)
// and nothing else, so plain, chain and tree decoding with the same seed commit the same tokens: the decode
// loop applies the sampler to the target's logits at each tree node it visits (the target-only walk).
// Batched and single-token evaluations give logits that differ in the last bits, so the draw is also made as
// insensitive to such noise as an exact sampler can be: Gumbel-max (argmax of log p_i + G_i, G_i a Gumbel
// variable hashed from (seed, t, token id)) parts only when the top two perturbed scores are within the noise,
// a chance of about the noise per draw whatever the vocabulary, where inverting the cumulative distribution
// over 150K tokens moves some boundary under almost any noise. Over the whole vocabulary that needs a log per
// token, so it runs on two levels, each an exact Gumbel-max: the block of 256 ids by the blocks' masses, then
// the token within the block.
#pragma once

#include "decode/token_constraint.h"

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

namespace pdf {

struct sampling_params {
    float    temperature       = 0.0f;  // <= 0: greedy
    int      top_k             = 0;     // <= 0: off
    float    top_p             = 1.0f;  // >= 1: off; 0 keeps the most likely token only
    float    min_p             = 0.0f;  // <= 0: off
    float    typical_p         = 1.0f;  // >= 1: off
    float    repeat_penalty    = 1.0f;  // 1: off
    float    presence_penalty  = 0.0f;
    float    frequency_penalty = 0.0f;
    int      repeat_last_n     = 64;    // tokens the penalties look back over (prompt included); -1: all; 0: off
    std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logits first (-inf bans a token)
    uint64_t seed       = 0;
    int      n_logprobs = -1;  // >= 0: record each drawn token's log-probability and the n most likely tokens'
    bool     post_sampling_probs = false;  // ... in the draw's distribution (after every stage), not the logits'
    // a grammar: its disallowed tokens removed first (decode/token_constraint.h); asked by the sampling verifier
    std::shared_ptr<token_constraint> constraint;

    bool penalties_on() const;
    // whether drawing needs the logits on the host; false: plain greedy, the device's argmax suffices
    bool needs_logits() const;
    // throws std::invalid_argument naming the first parameter out of range
    void validate(int64_t n_vocab) const;
};

// the key of output position t's draw: SplitMix64's finaliser over the seed, then over it xor t
uint64_t draw_key(uint64_t seed, uint64_t t);
// the Gumbel variable of `index` in a draw: -log(-log(u)), u = (splitmix64(key ^ index) >> 11 + 0.5) / 2^53;
// index: a token id, or 2^40 + a block number (ids >> 8)
double draw_gumbel(uint64_t key, uint64_t index);

// one generated token's log-probabilities: log-softmax of the target's raw logits, before any stage (with
// post_sampling_probs: the log of the draw's probabilities, the tokens every stage removed left out)
struct token_logprobs {
    float                                  logprob = 0.0f;  // the drawn token's
    std::vector<std::pair<int32_t, float>> top;             // the most likely tokens, best first (ties: lower id)
};

class token_sampler {
  public:
    token_sampler(const sampling_params & params, int64_t n_vocab, int n_ctx);

    // the tokens before the first draw (the prompt): the penalties' history
    void set_history(const int32_t * tokens, int n);
    // a committed token joins the history
    void accept(int32_t token);

    // the token for output position t from `logits` ([n_vocab]), among the `allowed` ones (a bit per token id;
    // nullptr: any); the logits are not modified
    int32_t sample(const float * logits, uint64_t t, const uint32_t * allowed = nullptr);
    // after sample(): the probability the last draw gave `token` (0 when a stage removed it)
    double probability(int32_t token) const;
    // after sample(): the candidates the draw chose among, by id, with their probabilities
    std::vector<std::pair<int32_t, double>> distribution() const;
    // after sample() with n_logprobs >= 0
    const token_logprobs & logprobs() const { return logprobs_; }

    const sampling_params & params() const { return p_; }

  private:
    struct candidate {
        float   logit;
        int32_t id;
    };
    // work_ <- the logits, the disallowed ones removed, biased and penalised; max_l_ their maximum
    void load_logits(const float * logits, const uint32_t * allowed);
    void apply_bias_and_penalties();
    bool truncate_candidates();             // top-k, typical-p, top-p, min-p (greedy: the best); true if reordered
    void compute_weights(bool reordered);   // weights_, total_ <- the draw's weights of what is left, by id
    void materialize_all();                 // cand_ <- every token (the explicit list)
    void select_top_k(int k);               // cand_ <- the k best of cand_, best first
    void softmax(double temperature);       // probs_ <- softmax of cand_'s logits / temperature
    void restore_id_order();                // cand_ by id
    void keep_typical(float p);
    void keep_top_p(float p);
    void keep_min_p(float p);
    void dense_top_k(int k);                // cand_ <- the k best of work_, best first
    void dense_top_p(float p);              // top-p on the dense set: excluded logits become -inf
    void dense_min_p(float p);
    void record_logprobs(const float * logits, int32_t token);
    void record_draw_probs(int32_t token);
    // the drawn index into weights_ (by id when dense_, else aligned with cand_)
    size_t draw_two_level(uint64_t key) const;

    sampling_params              p_;
    int64_t                      n_vocab_;
    int                          window_;   // penalty history length (0: off)
    std::deque<int32_t>          history_;  // the last window_ tokens
    std::vector<int32_t>         counts_;   // occurrences in history_, by id
    std::vector<float>           work_;     // the logits after bias and penalties (dense: -inf once excluded)
    float                        max_l_ = 0.0f;  // their maximum
    bool                         dense_ = true;  // the candidates are work_'s finite entries, else cand_
    std::vector<candidate>       cand_;     // the explicit candidates; by id once drawn from
    std::vector<double>          probs_;    // softmax() of cand_
    std::vector<float>           weights_;  // the draw's weights (unnormalised probabilities)
    double                       total_ = 1.0;
    std::vector<float>           scratch_;
    std::vector<uint8_t>         kept_;     // restore_id_order's marks, by id
    std::vector<double>          bin_mass_;  // top-p's bins: their masses, each token's
    std::vector<int32_t>         bins_;
    std::vector<std::pair<candidate, double>> edge_;
    token_logprobs               logprobs_;
};

}  // namespace pdf
