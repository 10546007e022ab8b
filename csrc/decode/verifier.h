// How the target's outputs become committed tokens: the first token after the prompt, and each round's walk
// down the verified tree (decode/tree.h walk_target). Greedy decoding picks the target's argmax (computed on the
// device); sampling draws from the target's logits with the full sampler chain (decode/sampler.h). Either way
// every committed token is the target's own choice, so speculative decoding commits what plain decoding would.
#pragma once

#include "decode/sampler.h"
#include "decode/tree.h"
#include "state/session.h"

#include <functional>
#include <memory>
#include <vector>

namespace pdf {

class verifier {
  public:
    virtual ~verifier() = default;
    // the first generated token, from the prompt's last position (session::prefill_marks: `next`, its logits)
    virtual int32_t first(const session::prefill_marks & m) = 0;
    // the walk down `t`, whose nodes the session evaluated last (every row read back)
    virtual void walk(const draft_tree & t, const session & s, std::vector<int> & rows, int32_t & bonus,
                      std::vector<float> & accept_prob) = 0;
    // the log-probabilities of the tokens chosen by the last first() / walk(), in order (empty unless asked for)
    virtual const std::vector<token_logprobs> & chosen_logprobs() const = 0;
    // time spent choosing so far: reading logits back, the sampler chain, the draw (greedy: 0)
    virtual double choose_ms() const { return 0.0; }
};

class greedy_verifier : public verifier {
  public:
    int32_t first(const session::prefill_marks & m) override { return m.next; }
    void    walk(const draft_tree & t, const session & s, std::vector<int> & rows, int32_t & bonus,
                 std::vector<float> & accept_prob) override;
    const std::vector<token_logprobs> & chosen_logprobs() const override { return none_; }

  private:
    std::vector<token_logprobs> none_;
};

class sampling_verifier : public verifier {
  public:
    // prompt: the penalties' history before the first draw; output position 0 is the first token
    sampling_verifier(const sampling_params & params, int64_t n_vocab, int n_ctx, const std::vector<int32_t> & prompt);
    int32_t first(const session::prefill_marks & m) override;
    void    walk(const draft_tree & t, const session & s, std::vector<int> & rows, int32_t & bonus,
                 std::vector<float> & accept_prob) override;
    const std::vector<token_logprobs> & chosen_logprobs() const override { return chosen_; }
    double                              choose_ms() const override { return choose_ms_; }

  private:
    // the token for the next output position from a row of logits (fetched by `row`)
    int32_t draw(const std::function<const float *()> & row);

    token_sampler               sampler_;
    double                      choose_ms_ = 0.0;
    uint64_t                    t_ = 0;  // the output position of the next draw
    std::vector<token_logprobs> chosen_;
};

// the verifier for these parameters: greedy on the device's argmax when nothing needs the logits
std::unique_ptr<verifier> make_verifier(const sampling_params & params, int64_t n_vocab, int n_ctx,
                                        const std::vector<int32_t> & prompt);

}  // namespace pdf
