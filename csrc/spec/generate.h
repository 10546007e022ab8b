// The decode loops, entirely in C++: prefill (reusing the longest cached prefix), then either one target
// evaluation per token (generate_greedy) or DFlash rounds of draft / verify / accept / commit
// (generate_dflash), until a stop token, max_tokens or the context limit.
#pragma once

#include "state/session.h"

#include <functional>
#include <string>
#include <vector>

namespace pdf {

struct generate_params {
    int                  max_tokens = 128;
    std::vector<int32_t> stop_tokens;  // end-of-generation ids; not included in the output
};

struct generate_timings {
    int    prompt_n       = 0;  // prompt tokens evaluated (after prefix reuse)
    int    cached_n       = 0;  // prompt tokens taken from the cache
    double prompt_ms      = 0;
    int    predicted_n    = 0;
    double predicted_ms   = 0;
    int    n_target_evals = 0;  // target forward passes during generation
    // speculative decoding
    int                 draft_n          = 0;  // tokens proposed by the drafter
    int                 draft_n_accepted = 0;  // of which the target agreed with
    int                 n_rounds         = 0;  // draft + verify rounds
    double              draft_ms         = 0;
    double              verify_ms        = 0;
    std::vector<int>    accepted_at;           // accepted_at[k]: rounds whose draft k+1 was accepted
    std::vector<int>    proposed_at;           // proposed_at[k]: rounds that proposed a draft k+1
};

struct generate_result {
    std::vector<int32_t> tokens;
    std::string          finish_reason;  // "stop", "length" (max_tokens or n_ctx), "abort"
    generate_timings     timings;
};

// called with each batch of newly committed tokens; return false to stop
using token_callback = std::function<bool(const int32_t * tokens, int n)>;

generate_result generate_greedy(session & s, const std::vector<int32_t> & prompt, const generate_params & params,
                                const token_callback & on_tokens);

// evaluate `prompt` after reusing the longest cached prefix; leaves the last token's argmax in s.argmax().
// on_chunk(first, n) is called after each committed chunk, whose capture_layers the target wrote into `ring`
// (a drafter's feature ring) when one is given.
void prefill(session & s, const std::vector<int32_t> & prompt, uint32_t n_ubatch, generate_timings & t,
             const std::vector<int> & capture_layers = {}, feature_ring * ring = nullptr,
             const std::function<void(int first, int n)> & on_chunk = nullptr);

class draft_session;

// DFlash speculative decoding, greedy: output identical to generate_greedy on the same target
generate_result generate_dflash(session & s, draft_session & d, const std::vector<int32_t> & prompt,
                                const generate_params & params, const token_callback & on_tokens);

}  // namespace pdf
