#include "decode/proposer_choice.h"
#include "decode/union_proposer.h"

namespace pdf {

generate_result generate_with(session & s, const call_proposers & with, const std::vector<int32_t> & prompt,
                              const generate_params & params, const token_callback & on_tokens, auto_stats & stats,
                              eval_batcher * batcher) {
    const speculation *       spec  = with.dflash;
    const ngram_speculation * ngram = with.ngram;
    if (with.mtp && (spec || ngram)) {
        throw std::invalid_argument("generate: the MTP head drafts alone (not with a DFlash drafter or n-gram lookup)");
    }
    if (with.mtp) {
        mtp_proposer    head(s, with.mtp->head, with.mtp->state, with.mtp->params);
        generate_result r = generate(s, head, prompt, params, on_tokens, batcher);
        stats             = head.stats();
        return r;
    }
    if (spec && ngram) {
        if (spec->params.mode != spec_mode::automatic) {
            throw std::invalid_argument("generate: a DFlash drafter and n-gram lookup together need spec_mode 'auto' "
                                        "(it chooses each round what of their merged tree to verify)");
        }
        dflash_proposer dflash(spec->drafter, spec->state, spec->params, s.is_recurrent());
        union_proposer  both(s, dflash, ngram->index, ngram->state.acceptance, ngram->against_drafter);
        generate_result r = generate(s, both, prompt, params, on_tokens, batcher);
        stats             = both.stats();
        return r;
    }
    if (ngram) {
        ngram_proposer lookup(s, ngram->index, ngram->state, ngram->params, ngram->block);
        generate_result r = generate(s, lookup, prompt, params, on_tokens, batcher);
        stats             = lookup.stats();
        return r;
    }
    if (!spec) {
        plain_proposer plain;
        return generate(s, plain, prompt, params, on_tokens, batcher);
    }
    dflash_proposer dflash(spec->drafter, spec->state, spec->params, s.is_recurrent());
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
