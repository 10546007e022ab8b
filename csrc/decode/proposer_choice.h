// Which proposer a generation runs (decode/proposer.h): DFlash's, in the mode its spec_params say, when a
// drafter is given; n-grams' (decode/ngram_proposer.h) when a lookup index is; the target's MTP head's
// (decode/mtp_proposer.h) when its session is; two or three of them merged into one tree each round when they are
// given together (decode/union_proposer.h); plain decoding otherwise. The bindings only say which of them a call
// has.
#pragma once

#include "decode/driver.h"
#include "decode/mtp_proposer.h"
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

// the target's MTP head for one target session, with what the decode loop has learnt about it and how it speculates
struct mtp_speculation {
    mtp_session &       head;
    speculation_state & state;
    spec_params         params;
};

// the proposers one generate call may run (nullptr: not that one)
struct call_proposers {
    const speculation *       dflash = nullptr;
    const ngram_speculation * ngram  = nullptr;
    const mtp_speculation *   mtp    = nullptr;
};

// generate() with the proposer `with` calls for: one of them, or two or three merged (auto: decode/union_proposer.h);
// none: plain decoding. `stats`: what auto decided; batcher: as generate's
generate_result generate_with(session & s, const call_proposers & with, const std::vector<int32_t> & prompt,
                              const generate_params & params, const token_callback & on_tokens, auto_stats & stats,
                              eval_batcher * batcher = nullptr);

// time_prefill_microbatches() with the drafter capturing as its prefill would (nullptr: none)
std::vector<double> time_prefill_with(session & s, const speculation * spec, const std::vector<int32_t> & tokens,
                                      const std::vector<int> & sizes, int reps);

}  // namespace pdf
