#include "decode/proposer_choice.h"
#include "decode/union_proposer.h"

#include <optional>
#include <stdexcept>

namespace pdf {

// two or three proposers merged into one tree each round (auto only: it chooses what of the tree to verify)
static generate_result generate_union(session & s, const call_proposers & with, const std::vector<int32_t> & prompt,
                                      const generate_params & params, const token_callback & on_tokens,
                                      auto_stats & stats, eval_batcher * batcher) {
    for (const spec_params * p : {with.dflash ? &with.dflash->params : nullptr,
                                  with.mtp ? &with.mtp->params : nullptr, with.ngram ? &with.ngram->params : nullptr}) {
        if (p && p->mode != spec_mode::automatic) {
            throw std::invalid_argument("generate: proposers together (a DFlash drafter, the MTP head, n-gram lookup) "
                                        "need spec_mode 'auto' (it chooses each round what of their merged tree to "
                                        "verify)");
        }
    }
    std::optional<dflash_proposer> dflash;
    std::optional<mtp_proposer>    head;
    std::optional<lookup_source>   lookup;
    if (with.dflash) {
        dflash.emplace(with.dflash->drafter, with.dflash->state, with.dflash->params, s.is_recurrent());
    }
    if (with.mtp) {
        head.emplace(s, with.mtp->head, with.mtp->state, with.mtp->params);
    }
    if (with.ngram) {
        lookup.emplace(lookup_source{with.ngram->index, with.ngram->state.acceptance, with.ngram->against_drafter});
    }
    union_proposer  all(s, dflash ? &*dflash : nullptr, head ? &*head : nullptr, lookup ? &*lookup : nullptr);
    generate_result r = generate(s, all, prompt, params, on_tokens, batcher);
    stats             = all.stats();
    return r;
}

generate_result generate_with(session & s, const call_proposers & with, const std::vector<int32_t> & prompt,
                              const generate_params & params, const token_callback & on_tokens, auto_stats & stats,
                              eval_batcher * batcher) {
    if ((with.dflash != nullptr) + (with.ngram != nullptr) + (with.mtp != nullptr) >= 2) {
        return generate_union(s, with, prompt, params, on_tokens, stats, batcher);
    }
    if (with.mtp) {
        mtp_proposer    head(s, with.mtp->head, with.mtp->state, with.mtp->params);
        generate_result r = generate(s, head, prompt, params, on_tokens, batcher);
        stats             = head.stats();
        return r;
    }
    if (with.ngram) {
        const ngram_speculation * ngram = with.ngram;
        ngram_proposer  lookup(s, ngram->index, ngram->state, ngram->params, ngram->block);
        generate_result r = generate(s, lookup, prompt, params, on_tokens, batcher);
        stats             = lookup.stats();
        return r;
    }
    if (!with.dflash) {
        plain_proposer plain;
        return generate(s, plain, prompt, params, on_tokens, batcher);
    }
    dflash_proposer dflash(with.dflash->drafter, with.dflash->state, with.dflash->params, s.is_recurrent());
    generate_result r = generate(s, dflash, prompt, params, on_tokens, batcher);
    stats             = dflash.stats();
    return r;
}

std::vector<double> time_prefill_with(session & s, const speculation * spec, const std::vector<int32_t> & tokens,
                                      const std::vector<int> & sizes, int reps) {
    if (!spec) {
        plain_proposer plain;
        return time_prefill_microbatches(s, plain, tokens, sizes, reps);
    }
    dflash_proposer dflash(spec->drafter, spec->state, spec->params, s.is_recurrent());
    return time_prefill_microbatches(s, dflash, tokens, sizes, reps);
}

}  // namespace pdf
