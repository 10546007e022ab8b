#include "decode/union_proposer.h"

#include <algorithm>
#include <cmath>

namespace pdf {

union_proposer::union_proposer(const session & s, dflash_proposer & dflash, ngram_index & index,
                               acceptance_model & ngram_acceptance, acceptance_model & against_drafter)
    : s_(s), dflash_(dflash), index_(index), ngram_acceptance_(ngram_acceptance), against_drafter_(against_drafter) {}

int union_proposer::before_prefill(int reusable) {
    synced_ = false;  // a new prompt: the lookup's index is checked against it at the first round
    return dflash_.before_prefill(reusable);
}

void union_proposer::merge(int32_t anchor, int max_depth) {
    merged_ = drafter_tree_;
    origins_.assign(merged_.size(), origin{});
    p_.assign(merged_.size(), 1.0);
    for (int b = 1; b < merged_.size(); ++b) {
        origins_[b].drafter_rank = merged_.rank[b];
        origins_[b].drafter_logp = merged_.logp[b];
        p_[b]                    = dflash_.p_accept(merged_, b);
    }
    build_ngram_tree(lookup_, anchor, max_depth * (int) lookup_.size(), lookup_tree_);
    std::vector<int> at(lookup_tree_.size(), 0);  // lookup node -> merged node
    const int        drafted_depth = drafter_drafted_ ? drafter_tree_.max_depth() : 0;
    for (int j = 1; j < lookup_tree_.size(); ++j) {
        const int parent = at[lookup_tree_.parents[j]];
        int       node   = -1;
        for (int b = parent + 1; b < merged_.size() && node < 0; ++b) {
            node = merged_.parents[b] == parent && merged_.tokens[b] == lookup_tree_.tokens[j] ? b : -1;
        }
        if (node < 0) {
            node = merged_.add(lookup_tree_.tokens[j], parent, lookup_tree_.rank[j], lookup_tree_.logp[j]);
            origins_.push_back(origin{});
            p_.push_back(0.0);
        }
        at[j]                      = node;
        origin & o                 = origins_[node];
        o.lookup_rank              = lookup_tree_.rank[j];
        o.lookup_logp              = lookup_tree_.logp[j];
        // the drafter drafted here but another token: the lookup's node stands against the drafter's
        o.against = o.drafter_rank < 0 && lookup_tree_.depth[j] <= drafted_depth;
        const acceptance_model & learnt = o.against ? against_drafter_ : ngram_acceptance_;
        const double q = learnt.p_accept(lookup_tree_.depth[j], lookup_tree_.rank[j],
                                         std::exp((double) lookup_tree_.logp[j]));
        p_[node] = std::max(p_[node], q);
    }
    exclusive_siblings();
}

void union_proposer::exclusive_siblings() {
    // the target picks one token after a node: its children's acceptances are exclusive events. Each proposer's
    // own are (the drafter's ranks, the lookup's distinct continuations), but a drafter's node and a lookup's
    // sibling were each learnt without the other, and together may claim more than certainty. Capped in
    // decreasing order so that they never do, the better one keeping its estimate.
    std::vector<int> children;
    for (int parent = 0; parent < merged_.size(); ++parent) {
        children.clear();
        for (int b = parent + 1; b < merged_.size(); ++b) {
            if (merged_.parents[b] == parent) {
                children.push_back(b);
            }
        }
        std::sort(children.begin(), children.end(), [&](int a, int b) { return p_[a] > p_[b]; });
        double left = 1.0;
        for (int c : children) {
            p_[c] = std::min(p_[c], left);
            left -= p_[c];
        }
    }
}

void union_proposer::order_best_first(int limit, draft_tree & out) {
    // best first by P(the accepted path reaches the node): a frontier of the taken nodes' children
    out.reset(merged_.tokens[0]);
    ordered_origins_.assign(1, origin{});
    ordered_p_.assign(1, 1.0);
    std::vector<double> reach(merged_.size(), 0.0);
    std::vector<int>    placed(merged_.size(), -1);  // merged node -> node of out
    std::vector<bool>   taken(merged_.size(), false);
    reach[0] = 1.0, placed[0] = 0, taken[0] = true;
    while (out.size() - 1 < limit) {
        int    best   = -1;
        double best_r = -1.0;
        for (int b = 1; b < merged_.size(); ++b) {
            if (!taken[b] && taken[merged_.parents[b]] && reach[merged_.parents[b]] * p_[b] > best_r) {
                best   = b;  // (ties: the earlier node, the drafter's order first)
                best_r = reach[merged_.parents[b]] * p_[b];
            }
        }
        if (best < 0) {
            break;
        }
        taken[best]  = true;
        reach[best]  = best_r;
        placed[best] = out.add(merged_.tokens[best], placed[merged_.parents[best]], merged_.rank[best],
                               merged_.logp[best]);
        ordered_origins_.push_back(origins_[best]);
        ordered_p_.push_back(p_[best]);
    }
}

void union_proposer::propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) {
    speculative_ = false;
    lookup_.clear();
    drafter_drafted_ = dflash_.draft_candidates(anchor, start, max_depth, max_nodes, drafter_tree_);
    const int depth  = std::min({max_depth, dflash_.max_depth(), max_nodes - 1});
    if (depth > 0 && dflash_.costs()->knows_plain_step()) {
        index_.follow(s_.tokens(), synced_);
        lookup_ = index_.candidates(anchor, depth);
    }
    if (!drafter_drafted_ && lookup_.empty()) {
        stats_.n_skipped++;
        out.reset(anchor);
        return;
    }
    merge(anchor, depth);
    order_best_first(dflash_.node_limit(max_nodes), ordered_);
    const int b = verify_budget(ordered_, ordered_p_, *dflash_.costs(), s_.is_recurrent());
    out         = ordered_;
    out.truncate(1 + b);
    speculative_ = b > 0;
    (b == 0 ? stats_.n_plain : out.is_chain() ? stats_.n_chain : stats_.n_tree)++;
}

void union_proposer::count(const draft_tree & t, const std::vector<int> & rows) {
    bool in_round[2] = {false, false};
    for (int b = 1; b < t.size(); ++b) {
        const bool by[2] = {ordered_origins_[b].drafter_rank >= 0, ordered_origins_[b].lookup_rank >= 0};
        for (int k : {0, 1}) {
            stats_.drafted_by[k] += by[k];
            in_round[k] = in_round[k] || by[k];
        }
    }
    for (size_t i = 1; i < rows.size(); ++i) {
        stats_.accepted_by[0] += ordered_origins_[rows[i]].drafter_rank >= 0;
        stats_.accepted_by[1] += ordered_origins_[rows[i]].lookup_rank >= 0;
    }
    stats_.rounds_by[0] += in_round[0];
    stats_.rounds_by[1] += in_round[1];
}

void union_proposer::after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                                  const std::vector<float> & accept_prob) {
    dflash_.queue_context(s, start, rows);
    count(t, rows);
    if (t.size() > 1) {
        for (int b = 1; b < t.size(); ++b) {
            if (accept_prob[b] < 0.0f) {
                continue;
            }
            const origin & o = ordered_origins_[b];
            if (o.drafter_rank >= 0) {
                dflash_.learn(t.depth[b], o.drafter_rank, o.drafter_logp, accept_prob[b]);
            }
            if (o.lookup_rank >= 0) {
                (o.against ? against_drafter_ : ngram_acceptance_)
                    .observe(t.depth[b], o.lookup_rank, std::exp((double) o.lookup_logp), accept_prob[b]);
            }
        }
    }
    if (drafter_drafted_) {
        dflash_.judge_round();
    }
}

}  // namespace pdf
