// Engine parameters resolved once (compare llama.cpp's llama_params_fit): from the target, the drafter and the
// user's options, every default and bound of a session and its drafter, and the sizes derived from them. A
// memory plan (pydflash.plan) and a load (pydflash.Model) both take them from here, so a plan is of the session
// a load opens; Python reads the result back.
#pragma once

#include "decode/proposer.h"
#include "models/dflash.h"
#include "models/model.h"

#include <vector>

namespace pdf {

// the most draft nodes one verify may hold (a verify of MAX_TREE_BUDGET + 1 tokens: the root and its nodes)
inline constexpr int MAX_TREE_BUDGET = 255;
// auto's budget when none is given: on the trained pairs budgets past it add ~nothing to tau (issue 27's note)
inline constexpr int AUTO_TREE_BUDGET = 63;
// tree / auto: candidates the drafter returns per position (DDTree's K; trees rarely take a sibling ranked lower)
inline constexpr int DRAFT_TOP_K = 8;
// hybrid targets keep each verified node's delta-rule inputs and conv row (state/recurrent_state.h): by default
// auto's trees stay within this share of the weights' memory (or TREE_STATE_MIN_BYTES, whichever is more)
inline constexpr double TREE_STATE_SHARE     = 0.25;
inline constexpr double TREE_STATE_MIN_BYTES = 512.0 * (1 << 20);
// the prefill micro-batches n_ubatch "auto" chooses among (pydflash/ubatch.py), at most llama.cpp's default:
// the feature ring and the compute buffer are sized for the largest, which a 24 GB card cannot spare much of
// next to a 27B model (a 2048-row ring of its drafter's features alone is 200 MiB)
inline constexpr int UBATCH_CANDIDATES[] = {64, 128, 256, 512};
// per-token recurrent states a session keeps without a drafter (and at least with one)
inline constexpr int DEFAULT_ROLLBACK = 16;
// n-gram lookup's block when none is asked for: matches rarely run longer, and it stays within DEFAULT_ROLLBACK
inline constexpr int NGRAM_DEFAULT_BLOCK = 8;
// the MTP head's block when none is asked for: a chain 3 drafts, llama.cpp's usual --spec-draft-n-max for
// draft-mtp; trees and auto 7 deep, as they verify only what pays (the trained pair's head: chain tau 3.49 at block 4,
// 5.71 at block 8)
inline constexpr int MTP_DEFAULT_BLOCK      = 4;
inline constexpr int MTP_DEFAULT_TREE_BLOCK = 8;

// whether the target's own MTP head drafts: never, when asked (an error where the file has none), or by default
// where the file has one and nothing else was asked for
enum class mtp_use { off, on, if_present };


// what the user chose (already checked at the boundary: pydflash.Model / pydflash.plan); 0: the default
struct engine_options {
    int       n_ctx        = 4096;
    int       n_ubatch     = 0;  // 0: "auto", sized for the largest candidate until measured
    int       block_size   = 0;  // 0: the drafter's trained block
    int       tree_budget  = 0;  // 0: by spec_mode (default_tree_budget)
    int       draft_window = 4096;
    spec_mode mode         = spec_mode::automatic;
    bool      ngram        = false;  // n-gram lookup drafts, alone or (auto) merged with the drafter's
    mtp_use   mtp          = mtp_use::off;
};

struct engine_params {
    // the target session
    int              n_ctx      = 0;
    int              n_ubatch   = 0;
    std::vector<int> ubatch_candidates;  // n_ubatch "auto": the sizes to time (else empty)
    int              n_rollback = DEFAULT_ROLLBACK;
    // the proposers (speculative: any): DFlash's drafter, n-gram lookup, the MTP head (block, tree_budget, mode)
    bool      speculative   = false;
    bool      drafter       = false;
    bool      ngram         = false;
    bool      mtp           = false;
    int       block         = 0;  // tokens per drafted block (the drafter's trained one unless asked)
    int       block_request = 0;  // what the draft session is asked for (0: the trained block)
    int       mtp_block     = 0;  // the MTP head's block merged with a drafter (0: `block`, the head alone)
    int       tree_budget   = 0;  // draft nodes per verify (chain: block - 1)
    int       draft_window  = 0;
    int       ring_capacity = 0;  // feature ring rows: a prefill micro-batch or the widest verify
    int       top_k         = 1;
    bool      with_logprobs = false;
    int       max_verify    = 0;  // the widest verify auto calibrates (0: verify_width_cap's default)
    spec_mode mode          = spec_mode::automatic;
};

// throws std::invalid_argument for a drafter's option given without a proposer, or for several proposers (merged
// into one tree each round) outside auto mode;
// unsupported_error when the MTP head is asked for and the file has none
engine_params resolve_engine_params(const target_model & target, const dflash_draft * draft,
                                    const engine_options & options);

// draft nodes per verify when tree_budget is not given: chain mode one block; tree mode four blocks' worth; auto
// up to AUTO_TREE_BUDGET, on hybrid targets only as far as what they keep per node stays within
// max(TREE_STATE_MIN_BYTES, TREE_STATE_SHARE of the weights)
int default_tree_budget(const target_model & target, spec_mode mode, int block);

// the MTP head's draft nodes per verify when tree_budget is not given: a chain's block - 1; a tree's as
// default_tree_budget, within top_k candidates at each of its block - 1 positions
int default_mtp_tree_budget(const target_model & target, spec_mode mode, int block, int top_k);

// the widest verify a drafter's cost model covers: max_verify, or (0) as wide as the feature ring and a tree allow
int verify_width_cap(int max_verify, int ring_rows);

}  // namespace pdf
