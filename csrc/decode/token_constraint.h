// What a grammar allows at each output position (a JSON schema, GBNF): the sampling verifier asks it on the
// target's path only, one mask per committed token as plain decoding would, and removes the tokens it disallows
// before every other stage of the chain. Drafts stay unconstrained: a draft the grammar forbids is one the target
// does not choose, so speculation stays lossless (the output is constrained plain decoding's).
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
};

}  // namespace pdf
