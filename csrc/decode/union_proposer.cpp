#include "decode/union_proposer.h"
#include "core/clock.h"
#include "state/eval_batcher.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace pdf {

// a new round's weight in a model's average drafting time and in a set's average rate
static constexpr double NEW_ROUND_WEIGHT = 0.2;
// the weight of a set's rating from one of the first probes, or from a probe after a cool-down
static constexpr double EARLY_RATING_WEIGHT = 0.5;
// where auto_stats counts each source (decode/proposer.h: 0 the drafter, 1 n-gram lookup, 2 the MTP head)
static constexpr int STATS_INDEX[3] = {0, 2, 1};

static model_set_rates & first_model_rates(dflash_proposer * dflash, mtp_proposer * mtp) {
    if (!dflash && !mtp) {
        throw std::invalid_argument("union_proposer: a model (a DFlash drafter or the MTP head) among its proposers");
    }
    return dflash ? dflash->state().merged : mtp->state().merged;
}

union_proposer::union_proposer(const session & s, dflash_proposer * dflash, mtp_proposer * mtp,
                               const lookup_source * lookup)
    : s_(s), dflash_(dflash), mtp_(mtp), lookup_source_(lookup), rates_(first_model_rates(dflash, mtp)) {
    if ((dflash != nullptr) + (mtp != nullptr) + (lookup != nullptr) < 2) {
        throw std::invalid_argument("union_proposer: two or three proposers");
    }
    if (dflash_) {
        capture_ = dflash_->capture();
    }
    if (mtp_) {
        capture_.insert(capture_.end(), mtp_->capture().begin(), mtp_->capture().end());
    }
}

ring_set union_proposer::rings() {
    ring_set r = dflash_ ? dflash_->rings() : ring_set{};
    if (mtp_) {
        r += mtp_->rings();
    }
    return r;
}

int union_proposer::before_prefill(int reusable) {
    synced_ = false;  // a new prompt: the lookup's index is checked against it at the first round
    int n   = dflash_ ? dflash_->before_prefill(reusable) : reusable;
    if (mtp_) {
        const int m = mtp_->before_prefill(n);
        if (m < n) {  // the head cannot continue the prefix: neither does the drafter
            n = dflash_ ? dflash_->before_prefill(m) : m;
        }
    }
    return n;
}

void union_proposer::before_eval(int first, int n) {
    if (dflash_) {
        dflash_->before_eval(first, n);
    }
    if (mtp_) {
        mtp_->before_eval(first, n);
    }
}

void union_proposer::after_prefill_chunk(int first, int n) {
    if (dflash_) {
        dflash_->after_prefill_chunk(first, n);
    }
    if (mtp_) {
        mtp_->after_prefill_chunk(first, n);
    }
}

void union_proposer::plan_in(eval_batcher * batch) {
    proposer::plan_in(batch);
    if (dflash_) {
        dflash_->plan_in(batch);  // (its drafts, its cool-down)
    }
    if (mtp_) {
        mtp_->plan_in(batch);
    }
}

int union_proposer::max_depth() const {
    return std::max(dflash_ ? dflash_->max_depth() : 0, mtp_ ? mtp_->max_depth() : 0);
}

int union_proposer::node_limit(int max_nodes) {
    // within every ring's rows, and the first model's tree budget
    const int n = std::min(max_nodes, rings().capacity());
    return dflash_ ? dflash_->node_limit(n) : mtp_->node_limit(n);
}

int union_proposer::all_models() const {
    return (dflash_ ? 1 << DFLASH : 0) | (mtp_ ? 1 << MTP : 0);
}

int union_proposer::best_set(int m) const {
    // (a set of no model is not chosen here: the lookup's acceptance is learnt where models drafted beside it, and
    // overrates it alone; plain rounds are the cool-down's)
    const int all  = all_models();
    int       best = all;
    for (int set = 1; set < all; ++set) {
        best = (set & ~all) == 0 && rates_.relative[m][set] > rates_.relative[m][best] ? set : best;
    }
    return best;
}

int union_proposer::choose_models() {
    if (!dflash_ || !mtp_) {
        return all_models();  // one model: nothing to choose
    }
    const int  m   = !lookup_.empty();
    const bool due = rates_.rounds++ >= rates_.next_probe || rates_.rated[m] < FIRST_PROBES;
    // the set chosen before a cool-down ran behind plain decoding: a probe rates the sets again
    reprobe_       = rates_.cooled;
    rates_.cooled  = false;
    probing_       = due || reprobe_;
    return probing_ ? all_models() : best_set(m);
}

void union_proposer::schedule_probe(int m) {
    // while probes keep rating the same set best, they come half as often (each costs every model's run and a
    // wider tree), the first ones aside; a change brings them back to every PROBE_EVERY rounds
    const int  best   = best_set(m);
    const bool stable = rates_.rated[m] > FIRST_PROBES && best == rates_.probe_best[m];
    rates_.probe_every = stable ? std::min(2 * rates_.probe_every, PROBE_EVERY_MAX) : PROBE_EVERY;
    rates_.probe_best[m] = best;
    rates_.next_probe    = rates_.rounds + rates_.probe_every - 1;
}

bool union_proposer::draft_model(int k, int32_t anchor, int start, int max_depth, int max_nodes) {
    // waits for other sessions' computes (a batch's drafter graph) are not this model's cost
    const auto   waited  = [&] { return s_.compute()->waited_ms() + eval_batcher::waited_ms(); };
    const auto   t0      = clock_type::now();
    const double w0      = waited();
    const bool   drafted = k == DFLASH ? dflash_->candidates(anchor, start, max_depth, max_nodes, trees_[k])
                                       : mtp_->candidates(anchor, start, max_depth, max_nodes, *costs(), trees_[k]);
    const double ms      = std::max(0.0, ms_since(t0) - (waited() - w0));
    if (drafted) {
        // the faster of its first two runs (the first also builds its graphs), then a running average
        const int n     = rates_.model_runs[k]++;
        double &  usual = rates_.model_ms[k];
        usual = n == 0 ? ms : n == 1 ? std::min(usual, ms) : (1.0 - NEW_ROUND_WEIGHT) * usual + NEW_ROUND_WEIGHT * ms;
    }
    return drafted;
}

template <class P> void union_proposer::absorb(const draft_tree & t, int k, P p) {
    std::vector<int> at(t.size(), 0);  // node of t -> merged node
    for (int j = 1; j < t.size(); ++j) {
        const int parent = at[t.parents[j]];
        int       node   = -1;
        for (int b = parent + 1; b < merged_.size() && node < 0; ++b) {
            node = merged_.parents[b] == parent && merged_.tokens[b] == t.tokens[j] ? b : -1;
        }
        if (node < 0) {
            node = merged_.add(t.tokens[j], parent, t.rank[j], t.logp[j]);
            origins_.push_back(origin{});
        }
        at[j]      = node;
        origin & o = origins_[node];
        o.rank[k]  = t.rank[j];
        o.logp[k]  = t.logp[j];
        o.p[k]     = p(t, j, o);
    }
}

void union_proposer::merge(int32_t anchor, int max_depth) {
    merged_.reset(anchor);
    origins_.assign(1, origin{});
    int models_depth = 0;  // the deepest any model drafted
    for (int k = 0; k < N_MODELS; ++k) {
        if (drafted_[k]) {
            models_depth = std::max(models_depth, trees_[k].max_depth());
            absorb(trees_[k], k, [&](const draft_tree & t, int j, const origin &) {
                return k == DFLASH ? dflash_->p_accept(t, j) : mtp_->p_accept(t, j);
            });
        }
    }
    if (lookup_.empty()) {
        return;
    }
    build_ngram_tree(lookup_, anchor, max_depth * (int) lookup_.size(), lookup_tree_);
    absorb(lookup_tree_, LOOKUP, [&](const draft_tree & t, int j, origin & o) {
        // a model drafted here but another token: the lookup's node stands against the model's
        o.against      = o.rank[DFLASH] < 0 && o.rank[MTP] < 0 && t.depth[j] <= models_depth;
        const double q = std::exp((double) t.logp[j]);
        o.p_against    = lookup_source_->against_drafter.p_accept(t.depth[j], t.rank[j], q);
        return lookup_source_->acceptance.p_accept(t.depth[j], t.rank[j], q);
    });
}

double union_proposer::lookup_p(int b, int models) const {
    // against the set's models where one of them drafted that deep but none this token
    const origin & o     = origins_[b];
    int            depth = 0;
    bool           any   = false;
    for (int k = 0; k < N_MODELS; ++k) {
        if ((models >> k & 1) && drafted_[k]) {
            depth = std::max(depth, trees_[k].max_depth());
            any   = any || o.rank[k] >= 0;
        }
    }
    return !any && merged_.depth[b] <= depth ? o.p_against : o.p[LOOKUP];
}

void union_proposer::node_p(int models, std::vector<double> & p) const {
    p.assign(merged_.size(), -1.0);
    p[0] = 1.0;
    for (int b = 1; b < merged_.size(); ++b) {
        for (int k = 0; k < N_SOURCES; ++k) {
            if (origins_[b].rank[k] >= 0 && (k == LOOKUP || (models >> k & 1))) {
                p[b] = std::max(p[b], k == LOOKUP ? lookup_p(b, models) : origins_[b].p[k]);
            }
        }
    }
    // the target picks one token after a node: its children's acceptances are exclusive events. Each source's own
    // are (a model's ranks, the lookup's distinct continuations), but siblings from different sources were each
    // learnt without the other, and together may claim more than certainty. Capped in decreasing order so that
    // they never do, the better one keeping its estimate.
    std::vector<int> children;
    for (int parent = 0; parent < merged_.size(); ++parent) {
        children.clear();
        for (int b = parent + 1; b < merged_.size(); ++b) {
            if (merged_.parents[b] == parent && p[b] >= 0.0) {
                children.push_back(b);
            }
        }
        std::sort(children.begin(), children.end(), [&](int a, int b) { return p[a] > p[b]; });
        double left = 1.0;
        for (int c : children) {
            p[c] = std::min(p[c], left);
            left -= p[c];
        }
    }
}

void union_proposer::order_best_first(const std::vector<double> & p, int limit, bool chain, draft_tree & out,
                                      std::vector<origin> & origins, std::vector<double> & out_p) const {
    // best first by P(the accepted path reaches the node): a frontier of the taken nodes' children
    out.reset(merged_.tokens[0]);
    origins.assign(1, origin{});
    out_p.assign(1, 1.0);
    std::vector<double> reach(merged_.size(), 0.0);
    std::vector<int>    placed(merged_.size(), -1);  // merged node -> node of out
    std::vector<bool>   taken(merged_.size(), false);
    reach[0] = 1.0, placed[0] = 0, taken[0] = true;
    int tip  = 0;  // the last node taken
    while (out.size() - 1 < limit) {
        int    best   = -1;
        double best_r = -1.0;
        for (int b = 1; b < merged_.size(); ++b) {
            const int parent = merged_.parents[b];
            if (p[b] >= 0.0 && !taken[b] && taken[parent] && (!chain || parent == tip) &&
                reach[parent] * p[b] > best_r) {
                best   = b;  // (ties: the earlier node, the first model's order first)
                best_r = reach[parent] * p[b];
            }
        }
        if (best < 0) {
            break;
        }
        taken[best]  = true;
        tip          = best;
        reach[best]  = best_r;
        placed[best] = out.add(merged_.tokens[best], placed[merged_.parents[best]], merged_.rank[best],
                               merged_.logp[best]);
        origins.push_back(origins_[best]);
        out_p.push_back(p[best]);
    }
}

void union_proposer::rate_model_sets(int limit) {
    // each non-empty subset of the models, as if only its nodes (and the lookup's) had been proposed: the round's
    // expected committed tokens over its models' drafting time and the verify's, at the cut auto would have made;
    // relative to every model's together in the same round (rates of different rounds differ by what the context
    // makes easy far more than by the set)
    const int           all   = all_models();
    const cost_model &  costs = *this->costs();
    std::vector<double> p, reach;
    std::array<double, 1 << N_MODELS> rate{};
    for (int set = all; set != 0; set = (set - 1) & all) {
        node_p(set, p);
        order_best_first(p, limit, costs.grid_widths(), trial_, trial_origins_, trial_p_);
        const int b = choose_verify_budget(trial_, trial_p_, costs, s_.is_recurrent());
        reach.assign(1 + b, 1.0);
        double expected = 1.0;
        bool   chain    = true;
        for (int i = 1; i <= b; ++i) {
            reach[i] = reach[trial_.parents[i]] * trial_p_[i];
            expected += reach[i];
            chain = chain && trial_.parents[i] == i - 1;
        }
        double ms = costs.verify_ms(1 + b, s_.is_recurrent() && !chain);
        for (int k = 0; k < N_MODELS; ++k) {
            ms += (set >> k & 1) ? rates_.model_ms[k] : 0.0;
        }
        rate[set] = expected / ms;
    }
    const int m = !lookup_.empty();
    for (int set = 1; set <= all; ++set) {
        const double relative = rate[set] / rate[all];
        // a running average, in which each of the first ratings weighs as much as all before it: each is made
        // with acceptance models that have learnt more (a useless head's confident drafts first rated it above a
        // trained drafter, 1.25 against 1.21 of every model's rate, then 0.73 against 1.06 at the fourth probe);
        // so does a probe after a cool-down, since the average chose a set that ran behind plain decoding
        const bool   early  = rates_.rated[m] < FIRST_PROBES || reprobe_;
        const double weight = rates_.rated[m] == 0 ? 1.0 : early ? EARLY_RATING_WEIGHT : NEW_ROUND_WEIGHT;
        rates_.relative[m][set] += weight * (relative - rates_.relative[m][set]);
    }
    rates_.rated[m]++;
    if (probing_) {
        schedule_probe(m);
    }
}

void union_proposer::propose(int32_t anchor, int start, int max_depth, int max_nodes, draft_tree & out) {
    speculative_ = false;
    probing_     = false;
    drafted_.fill(false);
    lookup_.clear();
    const int depth = std::min({max_depth, this->max_depth(), max_nodes - 1});
    // the lookup first: it costs nothing, and whether it matched is part of the choice of models
    if (lookup_source_ && depth > 0 && costs()->knows_plain_step()) {
        lookup_source_->index.follow(s_.tokens(), synced_);
        lookup_ = lookup_source_->index.candidates(anchor, depth);
    }
    // (a fresh process's first round sits out too, to time a plain step: not a cool-down)
    const bool knew     = costs()->knows_plain_step();
    const bool sits_out = depth > 0 && (dflash_ ? dflash_->sits_out() : mtp_->sits_out());
    rates_.cooled       = rates_.cooled || (sits_out && knew);
    reprobe_            = false;
    if (depth > 0 && !sits_out) {
        const int models = choose_models();
        for (int k = 0; k < N_MODELS; ++k) {
            drafted_[k] = (models >> k & 1) && draft_model(k, anchor, start, max_depth, max_nodes);
        }
    }
    if (!drafted_[DFLASH] && !drafted_[MTP] && lookup_.empty()) {
        stats_.n_skipped++;
        out.reset(anchor);
        return;
    }
    stats_.ran_by[STATS_INDEX[DFLASH]] += drafted_[DFLASH];
    stats_.ran_by[STATS_INDEX[MTP]] += drafted_[MTP];
    stats_.ran_by[STATS_INDEX[LOOKUP]] += !lookup_.empty();
    merge(anchor, depth);
    const int limit   = node_limit(max_nodes);
    const int drafted = (drafted_[DFLASH] ? 1 << DFLASH : 0) | (drafted_[MTP] ? 1 << MTP : 0);
    if (drafted_[DFLASH] && drafted_[MTP]) {  // every model drafted (one model alone: no sets to rate)
        rate_model_sets(limit);
    }
    node_p(drafted, p_);
    order_best_first(p_, limit, costs()->grid_widths(), ordered_, ordered_origins_, ordered_p_);
    const int b = verify_budget(ordered_, ordered_p_, *costs(), s_.is_recurrent());
    out         = ordered_;
    out.truncate(1 + b);
    speculative_ = b > 0;
    (b == 0 ? stats_.n_plain : out.is_chain() ? stats_.n_chain : stats_.n_tree)++;
}

void union_proposer::count(const draft_tree & t, const std::vector<int> & rows) {
    std::array<bool, N_SOURCES> in_round{};
    for (int b = 1; b < t.size(); ++b) {
        for (int k = 0; k < N_SOURCES; ++k) {
            const bool by = ordered_origins_[b].rank[k] >= 0;
            stats_.drafted_by[STATS_INDEX[k]] += by;
            in_round[k] = in_round[k] || by;
        }
    }
    for (size_t i = 1; i < rows.size(); ++i) {
        for (int k = 0; k < N_SOURCES; ++k) {
            stats_.accepted_by[STATS_INDEX[k]] += ordered_origins_[rows[i]].rank[k] >= 0;
        }
    }
    for (int k = 0; k < N_SOURCES; ++k) {
        stats_.rounds_by[STATS_INDEX[k]] += in_round[k];
    }
}

void union_proposer::after_verify(const session & s, const draft_tree & t, int start, const std::vector<int> & rows,
                                  const std::vector<float> & accept_prob) {
    // every model follows the committed path, whether it drafted or not
    if (dflash_) {
        dflash_->queue_context(s, start, rows);
    }
    if (mtp_) {
        mtp_->follow(s, t, start, rows);
    }
    count(t, rows);
    for (int b = 1; b < t.size(); ++b) {
        if (accept_prob[b] < 0.0f) {
            continue;
        }
        const origin & o = ordered_origins_[b];
        if (o.rank[DFLASH] >= 0) {
            dflash_->learn(t.depth[b], o.rank[DFLASH], o.logp[DFLASH], accept_prob[b]);
        }
        if (o.rank[MTP] >= 0) {
            mtp_->learn(t.depth[b], o.rank[MTP], o.logp[MTP], accept_prob[b]);
        }
        if (o.rank[LOOKUP] >= 0) {
            (o.against ? lookup_source_->against_drafter : lookup_source_->acceptance)
                .observe(t.depth[b], o.rank[LOOKUP], std::exp((double) o.logp[LOOKUP]), accept_prob[b]);
        }
    }
    // a probe explores (every model drafts, the useless ones too): the cool-down judges the rounds auto chose
    if ((drafted_[DFLASH] || drafted_[MTP]) && !probing_) {
        dflash_ ? dflash_->judge_round() : mtp_->judge_round();
    }
}

}  // namespace pdf
