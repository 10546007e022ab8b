// The decode loop, entirely in C++: prefill (reusing the cached prompt prefix), then rounds of
// propose -> verify in one batched target evaluation -> accept -> commit (no replay), until a stop token,
// max_tokens, the context limit or an abort. What a round verifies is the proposer's choice
// (decode/proposer.h): the root alone (plain decoding), a chain or a tree of drafts. Committed tokens reach the
// caller in one batch per round.
#pragma once

#include "decode/proposer.h"
#include "decode/sampler.h"
#include "state/eval_batcher.h"
#include "state/session.h"

#include <functional>
#include <string>
#include <vector>

namespace pdf {

struct generate_params {
    int                  max_tokens = 128;
    std::vector<int32_t> stop_tokens;  // end-of-generation ids; not included in the output
    sampling_params      sampling;     // the default: greedy
};

struct generate_timings {
    int    prompt_n       = 0;  // prompt tokens evaluated (after prefix reuse)
    int    cached_n       = 0;  // prompt tokens taken from the cache
    double prompt_ms      = 0;
    int    predicted_n    = 0;
    double predicted_ms   = 0;
    int    n_target_evals = 0;  // target forward passes during generation
    double sample_ms      = 0;  // choosing tokens when sampling: logits read back, the sampler, the draw
    // speculative decoding
    int              draft_n          = 0;  // draft tokens verified (tree nodes below the root)
    int              draft_n_accepted = 0;  // of which the target agreed with (on the accepted path)
    int              n_rounds         = 0;  // rounds that verified drafts
    int              verify_n         = 0;  // tokens those rounds verified (roots included)
    double           draft_ms         = 0;
    double           verify_ms        = 0;
    std::vector<int> accepted_at;           // accepted_at[k]: rounds whose path reached depth k+1
    std::vector<int> proposed_at;           // proposed_at[k]: rounds that verified a draft at depth k+1
};

struct generate_result {
    std::vector<int32_t>        tokens;
    std::vector<token_logprobs> logprobs;  // one per token, with sampling.n_logprobs >= 0
    std::string                 finish_reason;  // "stop", "length" (max_tokens or n_ctx), "abort"
    int32_t                     stop_token = -1;  // the stop token that ended it (not in tokens), else -1
    token_logprobs              stop_logprobs;    // its log-probabilities, with sampling.n_logprobs >= 0
    generate_timings     timings;
};

// called with each batch of newly committed tokens (and their log-probabilities, with sampling.n_logprobs >= 0;
// else nullptr); return false to stop
using token_callback = std::function<bool(const int32_t * tokens, const token_logprobs * logprobs, int n)>;

// batcher: the model's, when other generations over its sessions may run at the same time (each target
// evaluation then joins theirs, state/eval_batcher.h); nullptr: every evaluation alone
generate_result generate(session & s, proposer & p, const std::vector<int32_t> & prompt,
                         const generate_params & params, const token_callback & on_tokens,
                         eval_batcher * batcher = nullptr);

// evaluate `prompt` as a generation begins (continuing from what the session's prompt cache holds of it,
// session::prefill_marks, which then has the last prompt token's greedy pick and logits); false after an abort.
// The proposer captures what it needs of each micro-batch.
bool prefill(session & s, proposer & p, const std::vector<int32_t> & prompt, generate_timings & t);

// Milliseconds per token of a prefill micro-batch of each size (how pydflash chooses n_ubatch "auto"): `reps`
// evaluations of `tokens`' first `size` tokens into an empty cache, as prefill runs them (committed whole, last
// logits, the proposer's captures), the fastest counting; a first, untimed one builds each graph. The session
// is left empty (a hybrid model's state cannot be rolled back past a long evaluation; and a new micro-batch
// size voids the prompt cache anyway).
std::vector<double> time_prefill_microbatches(session & s, proposer & p, const std::vector<int32_t> & tokens,
                                              const std::vector<int> & sizes, int reps);

}  // namespace pdf
