#include "spec/cost_model.h"

#include <algorithm>
#include <cmath>

namespace pdf {

// weight of a new measurement in a running average: recent rounds dominate (context grows, caches warm)
static constexpr double AVERAGE_WEIGHT = 0.2;

cost_model::cost_model(int max_width) : max_width_(std::max(1, max_width)) {
    for (int w = 1; w < max_width_; w *= 2) {
        grid_.push_back(w);
    }
    grid_.push_back(max_width_);
    chain_ms_.assign(grid_.size(), 0.0);
    tree_ms_.assign(grid_.size(), 0.0);
    chain_seen_.assign(grid_.size(), false);
    tree_seen_.assign(grid_.size(), false);
}

int cost_model::grid_index(int n) const {
    return (int) (std::lower_bound(grid_.begin(), grid_.end(), n) - grid_.begin());
}

double cost_model::curve_ms(int n, bool tree) const {
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
        return tree ? curve_ms(n, false) : 1.0 * n;  // nothing measured: proportional to the width
    }
    if (lo < 0) {
        return ms[hi] * n / grid_[hi];
    }
    if (hi < 0) {
        return ms[lo] * n / grid_[lo];
    }
    if (lo == hi) {
        return ms[lo];
    }
    const double t = double(n - grid_[lo]) / double(grid_[hi] - grid_[lo]);
    return ms[lo] + t * (ms[hi] - ms[lo]);
}

double cost_model::verify_ms(int n, bool tree) const {
    return drift_ * curve_ms(n, tree);
}

void cost_model::calibrate_verify(int n, bool tree, double ms) {
    const int i = grid_index(n);
    if (i >= (int) grid_.size() || grid_[i] != n) {
        return;  // calibration runs at grid widths
    }
    (tree ? tree_ms_ : chain_ms_)[i] = ms;
    (tree ? tree_seen_ : chain_seen_)[i] = true;
}

void cost_model::observe_verify(int n, bool tree, double ms) {
    if (!calibrated_) {
        // no calibrated shape (chain and tree modes do not need one): the first time of a grid width stands
        calibrate_verify(n, tree, ms);
        return;
    }
    drift_ = (1 - AVERAGE_WEIGHT) * drift_ + AVERAGE_WEIGHT * ms / curve_ms(n, tree);
}

void cost_model::observe_draft(double ms) {
    draft_ms_   = draft_seen_ ? (1 - AVERAGE_WEIGHT) * draft_ms_ + AVERAGE_WEIGHT * ms : ms;
    draft_seen_ = true;
}

void cost_model::observe_spec_round(int committed, double ms, bool fresh) {
    const double rate = committed / std::max(ms, 1e-6);
    spec_rate_ = spec_rate_ > 0 && !fresh ? (1 - AVERAGE_WEIGHT) * spec_rate_ + AVERAGE_WEIGHT * rate : rate;
}

}  // namespace pdf
