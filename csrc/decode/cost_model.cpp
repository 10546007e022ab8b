#include "decode/cost_model.h"

#include <algorithm>
#include <atomic>
#include <cmath>

namespace pdf {

// weight of a new measurement in a running average: recent rounds dominate (context grows, caches warm)
static constexpr double AVERAGE_WEIGHT = 0.2;
static constexpr double FRESH_WEIGHT   = 0.5;
static constexpr double STALL_BOUND    = 2.0;

cost_model::cost_model(int max_width) : max_width_(std::max(1, max_width)) {
    for (int w = 1; w < max_width_; w = w < DENSE_WIDTHS ? w + 1 : 2 * w) {
        grid_.push_back(w);
    }
    grid_.push_back(max_width_);
    chain_ms_.assign(grid_.size(), 0.0);
    tree_ms_.assign(grid_.size(), 0.0);
    chain_seen_.assign(grid_.size(), false);
    tree_seen_.assign(grid_.size(), false);
    chain_runs_.assign(grid_.size(), 0);
    tree_runs_.assign(grid_.size(), 0);
}

int cost_model::grid_index(int n) const {
    return (int) (std::lower_bound(grid_.begin(), grid_.end(), n) - grid_.begin());
}

bool cost_model::calibrated() const {
    return std::all_of(chain_seen_.begin(), chain_seen_.end(), [](bool seen) { return seen; });
}

int cost_model::widest_measured_chain() const {
    for (int i = (int) grid_.size() - 1; i >= 0; --i) {
        if (chain_seen_[i]) {
            return grid_[i];
        }
    }
    return 0;
}

static std::atomic<int> grid_widths_forced{-1};

void cost_model::force_grid_widths(int on) {
    grid_widths_forced = on;
}

int cost_model::forced_grid_widths() {
    return grid_widths_forced.load();
}

static bool power_of_two(int n) {
    return n > 0 && (n & (n - 1)) == 0;
}

bool cost_model::verifiable(int n, int n_max) const {
    if (grid_widths_) {
        return n == n_max || n == max_width_ || power_of_two(n);
    }
    return n == 1 || n == n_max || n % row_tile_ == 0;
}

int cost_model::widest_verifiable(int n) const {
    if (n >= max_width_) {
        return max_width_;
    }
    int w = 1;
    while (2 * w <= n) {
        w *= 2;
    }
    return w;
}

double cost_model::verify_ms(int n, bool tree) const {
    // A tree is never taken to cost less than the chain of its width: a recurrent target runs it level by level
    // (the chain's work and more). Estimated from a tree width measured further off (proportional below the
    // narrowest), a 3-node tree was taken at 24 ms beside a measured 31 ms chain of 3, and auto explored trees that
    // cost it more than chains (the qwen35 MTP pair, q4mix)
    return tree ? std::max(learnt_ms(n, true), learnt_ms(n, false)) : learnt_ms(n, false);
}

double cost_model::learnt_ms(int n, bool tree) const {
    n = std::clamp(n, 1, max_width_);
    const std::vector<double> & ms   = tree ? tree_ms_ : chain_ms_;
    const std::vector<bool> &   seen = tree ? tree_seen_ : chain_seen_;
    // linear between the nearest measured grid points around n (a tree falls back on the chain's time)
    int lo = -1, hi = -1;
    for (int i = 0; i < (int) grid_.size(); ++i) {
        if (!seen[i]) {
            continue;
        }
        if (grid_[i] <= n) {
            lo = i;
        }
        if (grid_[i] >= n && hi < 0) {
            hi = i;
        }
    }
    if (lo < 0 && hi < 0) {
        return tree ? learnt_ms(n, false) : 1.0 * n;  // nothing measured: proportional to the width
    }
    if (lo < 0) {
        return ms[hi] * n / grid_[hi];
    }
    if (hi < 0) {
        // past the widest measured (optimistic: a round there measures it): a chain as the widest on a GPU, where
        // a few more rows cost next to nothing, and on the CPU as the widest scaled by the square root of the
        // widths. There time grows with the rows (as n^0.75 on the cost-realistic MoE pairs, n^0.6-0.75 on the
        // dense ones); taken flat, auto on the qwen35moe q8_0 pair explored wide verifies that lost and cooled
        // down (1.03-1.06x plain decoding against 1.13-1.16x), and a fresh process's first round on the tiny
        // pairs verified a 64-node tree (30 plain steps). A tree: the chain there in the ratio measured at its
        // widest.
        if (tree) {
            return learnt_ms(n, false) * ms[lo] / learnt_ms(grid_[lo], false);
        }
        return grid_widths_ ? ms[lo] : ms[lo] * std::sqrt(double(n) / grid_[lo]);
    }
    if (lo == hi) {
        return ms[lo];
    }
    const double t = double(n - grid_[lo]) / double(grid_[hi] - grid_[lo]);
    return ms[lo] + t * (ms[hi] - ms[lo]);
}

void cost_model::calibrate_verify(int n, bool tree, double ms) {
    const int i = grid_index(n);
    if (i >= (int) grid_.size() || grid_[i] != n) {
        return;  // measured at grid widths
    }
    (tree ? tree_ms_ : chain_ms_)[i] = ms;
    (tree ? tree_seen_ : chain_seen_)[i] = true;
}

void cost_model::observe(const round & r) {
    observe_verify(r.width, r.tree, r.verify_ms);
    rated_last_ = false;
    if (!r.drafted) {
        last_drafted_ = false;
        return;
    }
    observe_draft(r.draft_ms);
    // Rated: every round chosen once acceptance was learnt, those that explored a width not measured yet
    // included (rated without them, on the cost-realistic qwen35 pair at width 768 the first wide verifies all
    // explored and only rounds that verified nothing were judged: cool-downs grew from those alone, and one
    // generation of 192 tokens decoded at 1.11x or 1.53x plain by which rounds came first). Before acceptance is
    // learnt a round, chosen on its prior, is not rated, but for rounds that drafted and verified nothing past
    // the first PRIOR_DECLINES: they teach acceptance nothing, and a prior that doubts every draft would keep
    // auto drafting at every round, never judged.
    declined_ += r.learning && r.width == 1;
    if (!(r.learning && (r.width > 1 || declined_ <= PRIOR_DECLINES)) && !r.probe) {
        // (the first rated one is fresh: after a cool-down merged proposers probe before the set they choose)
        observe_spec_round(r.committed, r.round_ms, !last_drafted_);
        last_drafted_ = true;
        rated_last_   = true;
    }
}

void cost_model::observe_verify(int n, bool tree, double ms) {
    std::vector<double> & v    = tree ? tree_ms_ : chain_ms_;
    std::vector<bool> &   seen  = tree ? tree_seen_ : chain_seen_;
    std::vector<int> &    runs  = tree ? tree_runs_ : chain_runs_;
    n = std::clamp(n, 1, max_width_);
    const int hi = grid_index(n);                      // grid_[hi] >= n
    const int lo = grid_[hi] == n ? hi : hi - 1;       // grid_[lo] <= n
    // a width between two measured grid points counts for both, by how near it is, carried through the shape
    // between them. Where that shape is not known (either unmeasured), the observation only bounds the
    // unmeasured one from below, optimistically (a wider batch costs at least as much, a narrower one at least
    // its share by width), and a round that explores it measures it; a measured width is not moved by a guessed
    // shape (a width-6 verify carried flat onto a measured width 4 raised its time by half on the CPU, 36.6
    // against 25 ms, and auto stopped choosing it).
    double carried[2] = {ms, ms}, weight[2] = {1.0, 0.0};  // lo, hi
    if (lo != hi && seen[lo] && seen[hi]) {
        const double at_n = learnt_ms(n, tree);
        const double t    = double(n - grid_[lo]) / double(grid_[hi] - grid_[lo]);
        carried[0]        = ms * learnt_ms(grid_[lo], tree) / at_n;
        carried[1]        = ms * learnt_ms(grid_[hi], tree) / at_n;
        weight[0]         = 1.0 - t;
        weight[1]         = t;
    } else if (lo != hi) {
        carried[0] = ms * grid_[lo] / n;
        weight[0]  = seen[lo] ? 0.0 : 1.0;
        weight[1]  = seen[hi] ? 0.0 : 1.0;
    }
    for (int k : {0, 1}) {
        const int    i = k == 0 ? lo : hi;
        const double w = weight[k];
        if (w <= 0.0) {
            continue;
        }
        const double x = plausible(v, seen, i, carried[k]);
        if (seen[i]) {
            // at most twice the time so far: a stall (the machine busy elsewhere) moves it by a fifth at most
            v[i] += AVERAGE_WEIGHT * w * (std::min(x, STALL_BOUND * v[i]) - v[i]);
        } else {
            // not trusted yet: the first evaluation of a shape also builds its graph (a GPU's second captures it)
            v[i]    = runs[i] == 0 ? x : std::min(v[i], x);
            seen[i] = ++runs[i] >= trusted_after();
        }
    }
}

int cost_model::trusted_after() const {
    return grid_widths_ ? 3 : 2;
}

double cost_model::plausible(const std::vector<double> & v, const std::vector<bool> & seen, int i, double ms) const {
    // a batch costs no more than a wider one, nor more than as many narrower ones as it takes to hold it (it
    // could be run as those): a time past these bounds is a stall (the machine busy elsewhere), not the cost.
    // (Not the narrower one's time scaled by the widths' ratio: 5 rows cost 1.35x what 4 do on the CPU.)
    for (int j = 0; j < (int) grid_.size(); ++j) {
        if (seen[j] && j != i) {
            ms = std::min(ms, v[j] * std::ceil(std::max(1.0, double(grid_[i]) / grid_[j])));
        }
    }
    return ms;
}

void cost_model::observe_draft(double ms) {
    draft_ms_   = draft_seen_ ? (1 - AVERAGE_WEIGHT) * draft_ms_ + AVERAGE_WEIGHT * ms : ms;
    draft_seen_ = true;
}

void cost_model::observe_spec_round(int committed, double ms, bool fresh) {
    // a fresh run of speculation (after plain decoding) weighs its first round as much as all before it: one
    // round is a noisy witness, and what came before may be stale. Tokens and time are averaged apart, so a
    // round weighs by its time: a 140 ms round of a wide verify counts as the ten plain-sized rounds it takes the
    // time of (averaged per round, rates of a few short rounds that drafted and verified nothing outweighed it)
    const double w = fresh ? FRESH_WEIGHT : AVERAGE_WEIGHT;
    ms             = std::max(ms, 1e-6);
    last_rate_     = committed / ms;
    last_ms_       = ms;
    last_fresh_    = fresh;
    spec_tokens_   = spec_ms_ > 0 ? (1 - w) * spec_tokens_ + w * committed : committed;
    spec_ms_       = spec_ms_ > 0 ? (1 - w) * spec_ms_ + w * ms : ms;
}

void cost_model::set_spec_round(double tokens, double ms) {
    spec_tokens_ = tokens;
    spec_ms_     = std::max(ms, 1e-6);
}

std::vector<cost_model::measurement> cost_model::measured() const {
    std::vector<measurement> out;
    for (size_t i = 0; i < grid_.size(); ++i) {
        if (chain_seen_[i]) {
            out.push_back({grid_[i], false, chain_ms_[i]});
        }
        if (tree_seen_[i]) {
            out.push_back({grid_[i], true, tree_ms_[i]});
        }
    }
    return out;
}

void cost_model::restore(const std::vector<measurement> & table) {
    for (const measurement & m : table) {
        if (m.ms > 0 && std::isfinite(m.ms)) {
            calibrate_verify(m.width, m.tree, m.ms);
        }
    }
    for (size_t i = 0; i < grid_.size(); ++i) {
        chain_ms_[i] = plausible(chain_ms_, chain_seen_, (int) i, chain_ms_[i]);
        tree_ms_[i]  = plausible(tree_ms_, tree_seen_, (int) i, tree_ms_[i]);
    }
}

}  // namespace pdf
