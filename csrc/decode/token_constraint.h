// What a grammar allows at each output position (a JSON schema, GBNF): the sampling verifier asks it on the
// target's path only, one mask per committed token as plain decoding would, and removes the tokens it disallows
// before every other stage of the chain. The drafters draft unconstrained; a round's tree is cut before the first
// draft the grammar forbids (one the target cannot choose), so verifies are not spent on them, and the output
// stays constrained plain decoding's.
#pragma once

#include <cstdint>

namespace pdf {

class token_constraint {
  public:
    virtual ~token_constraint() = default;
    // the tokens allowed at the next output position, a bit per token id (bit i % 32 of word i / 32); never none
    virtual const uint32_t * allowed() = 0;
    // the token chosen there (every chosen token is committed)
    virtual void accept(int32_t token) = 0;
    // how many of `tokens` the grammar would take in turn from here (the state unchanged): a round verifies only
    // drafts the grammar allows (decode/stream.cpp), the others being drafts the target cannot choose
    virtual int valid_prefix(const int32_t * tokens, int n) = 0;
};

}  // namespace pdf
