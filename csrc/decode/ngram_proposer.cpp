#include "decode/ngram_proposer.h"

#include <algorithm>
#include <cmath>

namespace pdf {

double ngram_prior(int match_len) {
    // (0: no match, a guess: the context's most frequent token, right 2-3% of the time on code)
    return match_len <= 0 ? 0.03 : std::min(0.8, 0.15 + 0.15 * match_len);
}

void build_ngram_tree(const std::vector<ngram_candidate> & candidates, int32_t anchor, int budget, draft_tree & out) {
    out.reset(anchor);
    std::vector<int> n_children(1, 0);
    for (const ngram_candidate & c : candidates) {
        const float logp = (float) std::log(ngram_prior(c.match_len));
        int         node = 0;
        for (int32_t tok : c.tokens) {
            int child = -1;
            for (int j = node + 1; j < out.size() && child < 0; ++j) {
                child = out.parents[j] == node && out.tokens[j] == tok ? j : -1;
            }
            if (child < 0) {
                if (out.size() - 1 >= budget) {
                    return;
                }
                child = out.add(tok, node, n_children[node]++, logp);
                n_children.push_back(0);
            }
            node = child;
        }
    }
}

ngram_proposer::ngram_proposer(const session & s, ngram_index & index, speculation_state & state,
                               const spec_params & params, int block)
    : s_(s), index_(index), state_(state), params_(params), block_(block) {}

int ngram_proposer::before_prefill(int reusable) {
    synced_ = false;  // a new prompt: the index is checked against it at the first round
    return reusable;
}

void ngram_proposer::propose(int32_t anchor, int, int max_depth, int max_nodes, draft_tree & out) {
    drafted_     = false;
    speculative_ = false;
    out.reset(anchor);
    max_depth = std::min({max_depth, block_ - 1, max_nodes - 1});
    if (max_depth <= 0) {
        return;
    }
    index_.follow(s_.tokens(), synced_);
    const bool automatic = params_.mode == spec_mode::automatic;
    if (automatic && !state_.costs.knows_plain_step()) {
        stats_.n_skipped++;  // (a fresh process: the first round measures a plain step)
        return;
    }
    std::vector<ngram_candidate> found = index_.candidates(anchor, max_depth);
    if (found.empty() && automatic && index_.most_frequent() >= 0) {
        // no match: auto verifies a guess where a 2-row step costs (nearly) no more than a plain one, which is
        // what its cost model measures (some targets' 1-row steps are the slower on ggml's CPU kernels)
        found.push_back({{index_.most_frequent()}, 0});
    }
    if (found.empty()) {
        stats_.n_skipped++;
        return;
    }
    drafted_  = true;
    const int limit = tree_node_limit(max_nodes, state_.costs, params_.tree_budget);
    switch (params_.mode) {
        case spec_mode::chain:
            found.resize(1);
            build_ngram_tree(found, anchor, max_depth, out);
            break;
        case spec_mode::tree:
            build_ngram_tree(found, anchor, limit, out);
            break;
        case spec_mode::automatic: {
            build_ngram_tree(found, anchor, limit, full_);
            const int b = verify_budget(full_, state_.costs, state_.acceptance, s_.is_recurrent());
            out         = full_;
            out.truncate(1 + b);
            auto & n = b == 0 ? stats_.n_plain : out.is_chain() ? stats_.n_chain : stats_.n_tree;
            n++;
            break;
        }
    }
    speculative_ = out.size() > 1;
}

void ngram_proposer::after_verify(const session &, const draft_tree & t, int, const std::vector<int> &,
                                  const std::vector<float> & accept_prob) {
    learn_from_verify(state_.acceptance, t, accept_prob);
}

}  // namespace pdf
