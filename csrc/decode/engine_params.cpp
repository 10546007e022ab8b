#include "decode/engine_params.h"
#include "core/error.h"
#include "decode/ngram_index.h"
#include "state/recurrent_state.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace pdf {

static std::vector<int> ubatch_candidates(int n_ctx) {
    std::vector<int> sizes;
    for (int n : UBATCH_CANDIDATES) {
        if (n <= n_ctx) {
            sizes.push_back(n);
        }
    }
    return sizes.empty() ? std::vector<int>{n_ctx} : sizes;
}

int default_tree_budget(const target_model & target, spec_mode mode, int block) {
    if (mode == spec_mode::chain) {
        return block - 1;
    }
    int budget = std::min(mode == spec_mode::tree ? 4 * (block - 1) : AUTO_TREE_BUDGET, AUTO_TREE_BUDGET);
    const model_info & info = target.info();
    if (!info.recurrent_layers.empty()) {
        const double per_node = (double) recurrent_state::n_bytes_for(info, 2) - recurrent_state::n_bytes_for(info, 1);
        const double allowed  = std::max(TREE_STATE_MIN_BYTES, TREE_STATE_SHARE * (double) target.weight_bytes());
        budget = std::max(block - 1, std::min(budget, (int) std::floor(allowed / per_node) - 2));
    }
    return budget;
}

int verify_width_cap(int max_verify, int ring_rows) {
    return max_verify > 0 ? max_verify : std::min(AUTO_TREE_BUDGET + 1, ring_rows);
}

// the drafter's part: block, tree budget, the feature ring and what a hybrid target keeps for rollback
static void resolve_drafter(const target_model & target, const dflash_draft & draft, const engine_options & o,
                            engine_params & p) {
    const bool chain = o.mode == spec_mode::chain;
    p.speculative    = true;
    p.drafter        = true;
    p.mode           = o.mode;
    p.block_request  = o.block_size;
    p.block          = o.block_size > 0 ? o.block_size : draft.block_size();
    p.draft_window   = o.draft_window;
    // the feature ring holds one target evaluation's rows: a prefill micro-batch or a verify (a chain's block,
    // or a tree's root and nodes)
    p.max_verify     = chain ? 0 : 1 + (o.tree_budget > 0 ? o.tree_budget : AUTO_TREE_BUDGET);
    p.ring_capacity  = std::max(p.n_ubatch, p.max_verify);
    p.top_k          = chain ? 1 : DRAFT_TOP_K;
    p.with_logprobs  = !chain;
    p.tree_budget    = o.tree_budget > 0 ? o.tree_budget : default_tree_budget(target, o.mode, p.block);
    // a hybrid target keeps the state of every token (chain) or node (tree) of a verify
    p.n_rollback     = std::max({p.n_rollback, p.block, chain ? 0 : 1 + p.tree_budget});
}

// n-gram lookup: block and tree budget as a drafter's (no feature ring, no drafter of its own); a hybrid target
// keeps the state of every token or node of a verify
static void resolve_ngram(const target_model & target, const engine_options & o, engine_params & p) {
    p.speculative = true;
    p.ngram       = true;
    p.mode        = o.mode;
    p.block       = o.block_size > 0 ? o.block_size : NGRAM_DEFAULT_BLOCK;
    // (a tree of the default ngram_params' candidates holds at most max_candidates * (block - 1) nodes)
    p.tree_budget = o.tree_budget > 0 ? o.tree_budget
                                      : std::min(default_tree_budget(target, o.mode, p.block),
                                                 ngram_params{}.max_candidates * (p.block - 1));
    p.n_rollback  = std::max({p.n_rollback, p.block, o.mode == spec_mode::chain ? 0 : 1 + p.tree_budget});
}

int default_mtp_tree_budget(const target_model & target, spec_mode mode, int block, int top_k) {
    return mode == spec_mode::chain ? block - 1 : std::min(default_tree_budget(target, mode, block), top_k * (block - 1));
}

// the MTP head: block - 1 drafts a round, a chain or (tree, auto) a tree of its top-k candidates at those positions;
// a hybrid target keeps the state of each of its tokens or nodes
static void resolve_mtp(const target_model & target, const engine_options & o, engine_params & p) {
    const bool chain = o.mode == spec_mode::chain;
    p.speculative    = true;
    p.mtp            = true;
    p.mode           = o.mode;
    p.block          = o.block_size > 0 ? o.block_size : chain ? MTP_DEFAULT_BLOCK : MTP_DEFAULT_TREE_BLOCK;
    if (chain && o.tree_budget > p.block - 1) {
        throw std::invalid_argument(format("tree_budget = %d: an MTP chain drafts at most block_size - 1 = %d tokens",
                                           o.tree_budget, p.block - 1));
    }
    p.top_k       = chain ? 1 : DRAFT_TOP_K;
    p.tree_budget = o.tree_budget > 0 ? o.tree_budget : default_mtp_tree_budget(target, o.mode, p.block, p.top_k);
    p.max_verify  = 1 + p.tree_budget;
    p.n_rollback  = std::max({p.n_rollback, p.block, p.max_verify});
}

engine_params resolve_engine_params(const target_model & target, const dflash_draft * draft,
                                    const engine_options & o) {
    engine_params p;
    p.n_ctx = o.n_ctx;
    if (o.n_ubatch == 0) {
        p.ubatch_candidates = ubatch_candidates(o.n_ctx);
        p.n_ubatch          = p.ubatch_candidates.back();
    } else {
        // a micro-batch never holds more than the context (nor sizes the feature ring beyond it)
        p.n_ubatch = std::min(o.n_ubatch, o.n_ctx);
    }
    const bool head = o.mtp == mtp_use::on;
    if ((draft != nullptr) + o.ngram + head > 1 && o.mode != spec_mode::automatic) {
        std::string given;  // as pydflash names them
        for (const auto & [on, name] : {std::pair<bool, const char *>{draft != nullptr, "'dflash'"},
                                        {o.ngram, "'ngram'"}, {head, "'mtp'"}}) {
            given += on ? (given.empty() ? "" : ", ") + std::string(name) : "";
        }
        throw std::invalid_argument(format("proposers=(%s) merges %s into one tree, which spec_mode='auto' cuts each "
                                           "round: chain and tree modes take one proposer", given.c_str(),
                                           draft && o.ngram && head ? "all three" : "both"));
    }
    if (head && !target.has_mtp()) {
        throw unsupported_error(target.mtp_missing() + "; proposers=('mtp',) needs one");
    }
    if (draft) {
        resolve_drafter(target, *draft, o, p);
        // merged into the drafter's tree, within its budget: the lookup's candidates within its block; the head
        // runs while its drafts are worth verifying, at most its own block deep (unless one is asked for)
        p.ngram     = o.ngram;
        p.mtp       = head;
        p.mtp_block = head ? (o.block_size > 0 ? o.block_size : MTP_DEFAULT_TREE_BLOCK) : 0;
    } else if (o.mtp != mtp_use::off && target.has_mtp() && (head || !o.ngram)) {
        resolve_mtp(target, o, p);
        p.ngram = o.ngram;  // merged into the head's tree, within its block and budget
    } else if (o.ngram) {
        resolve_ngram(target, o, p);
    } else if (o.block_size > 0 || o.tree_budget > 0) {
        throw std::invalid_argument("block_size and tree_budget need a proposer: a draft model (draft_model_path), "
                                    "proposers=('ngram',) or a target with an MTP head");
    }
    return p;
}

}  // namespace pdf
