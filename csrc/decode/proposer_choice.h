// Which proposer a generation runs (decode/proposer.h): DFlash's, in the mode its spec_params say, when a
// drafter is given; n-grams' (decode/ngram_proposer.h) when a lookup index is; plain decoding otherwise. The
// bindings only say which of them a call has.
#pragma once

#include "decode/driver.h"
#include "decode/ngram_proposer.h"
#include "decode/proposer.h"
#include "state/draft_session.h"
#include "state/session.h"

#include <vector>

namespace pdf {

// a drafter for one target session, with what the decode loop has learnt about it and how it speculates
struct speculation {
    draft_session &     drafter;
    speculation_state & state;
    spec_params         params;
};

// n-gram lookup for one target session, with what the decode loop has learnt about it and how it speculates
struct ngram_speculation {
    ngram_index &       index;
    speculation_state & state;
    spec_params         params;
    int                 block;            // the deepest draft: block - 1 tokens
    acceptance_model &  against_drafter;  // merged with a drafter: its nodes where the drafter proposed another
};

// generate() with the proposer `spec` or `ngram` calls for (at most one of them; neither: plain decoding);
// `stats`: what auto decided
generate_result generate_with(session & s, const speculation * spec, const ngram_speculation * ngram,
                              const std::vector<int32_t> & prompt, const generate_params & params,
                              const token_callback & on_tokens, auto_stats & stats);

// time_prefill_microbatches() with the drafter capturing as its prefill would (nullptr: none)
std::vector<double> time_prefill_with(session & s, const speculation * spec, const std::vector<int32_t> & tokens,
                                      const std::vector<int> & sizes, int reps);

}  // namespace pdf
