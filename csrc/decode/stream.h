// One generation (decode/driver.h) as the sequence of target evaluations it needs, handed out one at a time: its
// prompt's micro-batches, then each round's verify (the proposer drafts as the round is handed out). The caller
// evaluates each one, alone (session::eval: generate) or together with other streams' (session_batch:
// generate_batch), and hands the stream back the time it took; the stream then commits, walks the verified
// tree and emits its tokens. Either way a stream commits what the target alone would produce.
#pragma once

#include "core/clock.h"
#include "decode/driver.h"
#include "decode/verifier.h"
#include "state/session_batch.h"

#include <memory>

namespace pdf {

class generation_stream {
  public:
    // checks the call (typed errors) before any work; the prompt's cached prefix is decided at the first next()
    generation_stream(session & s, proposer & p, const std::vector<int32_t> & prompt, const generate_params & params,
                      const token_callback & on_tokens);
    ~generation_stream();
    generation_stream(const generation_stream &)             = delete;
    generation_stream & operator=(const generation_stream &) = delete;

    // the next evaluation of this stream's session (false: the generation has ended, result() holds it); in a
    // round, the proposer has drafted its tree by the time this returns
    bool next(session_batch::part & out);
    // the evaluation next() gave has run (its results are in the session), taking eval_ms
    void evaluated(double eval_ms);
    // whether the stream decodes (its prompt is evaluated): what the next evaluation is, a round
    bool decoding() const { return phase_ == phase::decode; }
    session &         target() const { return s_; }
    proposer &        proposals() const { return p_; }
    generate_result & result() { return r_; }

  private:
    enum class phase { start, prefill, decode, done };
    struct round_state;
    // the prompt: its reusable prefix, or its next micro-batch's results committed
    void start_prefill();
    void prefill_evaluated();
    // the first generated token, then rounds until a stop token, max_tokens, the context limit or an abort
    void start_decoding();
    bool next_round(session_batch::part & out);
    int  depth_cap(int remaining) const;
    void round_evaluated(double eval_ms);
    void finish(const char * reason);

    session &                    s_;
    proposer &                   p_;
    const std::vector<int32_t> & prompt_;
    const generate_params &      params_;
    const token_callback &       on_tokens_;
    std::unique_ptr<verifier>    choose_;
    generate_result              r_;
    phase                        phase_ = phase::start;
    int                          next_chunk_ = 0;  // prefill: the first prompt position of the next micro-batch
    int                          chunk_n_    = 0;  // its tokens
    clock_type::time_point       t0_;              // the prefill's start, then the decoding's
    int32_t                      anchor_ = 0;      // the round's root token, at position start_
    int                          start_  = 0;
    std::unique_ptr<round_state> round_;
};

}  // namespace pdf
