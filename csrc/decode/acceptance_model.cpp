#include "decode/acceptance_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace pdf {

// the prior: this many pseudo-trials accepted at the bin's own drafter probability
static constexpr double PRIOR_TRIALS = 2.0;
// every observation of a cell ages its earlier ones by this factor (about the last 200 count)
static constexpr double DECAY = 0.995;
// nodes tried before the model counts as learnt (a few rounds: a round tries the accepted path's children)
static constexpr double LEARNT_TRIED = 16.0;

int acceptance_model::cell(int depth, int rank, double q) {
    const int d = depth <= 1 ? 0 : depth <= 3 ? 1 : depth <= 7 ? 2 : 3;
    const int r = rank == 0 ? 0 : 1;
    const int b = std::clamp((int) (q * N_BINS), 0, N_BINS - 1);
    return (d * N_RANK + r) * N_BINS + b;
}

double acceptance_model::bin_centre(int c) {
    return ((c % N_BINS) + 0.5) / N_BINS;
}

double acceptance_model::p_accept(int depth, int rank, double q) const {
    const int c = cell(depth, rank, q);
    return (accepted_[c] + PRIOR_TRIALS * bin_centre(c)) / (tried_[c] + PRIOR_TRIALS);
}

void acceptance_model::observe(int depth, int rank, double q, double accepted) {
    const int c  = cell(depth, rank, q);
    tried_[c]    = DECAY * tried_[c] + 1.0;
    accepted_[c] = DECAY * accepted_[c] + accepted;
}

bool acceptance_model::learnt() const {
    double tried = 0.0;
    for (double t : tried_) {
        tried += t;
    }
    return tried >= LEARNT_TRIED;
}

std::pair<double, double> acceptance_model::observed(int depth, int rank) const {
    const int first = cell(depth, rank, 0.0);
    double    tried = 0.0, accepted = 0.0;
    for (int b = 0; b < N_BINS; ++b) {
        tried += tried_[first + b];
        accepted += accepted_[first + b];
    }
    return {tried, accepted};
}

void acceptance_model::restore(const std::vector<double> & tried, const std::vector<double> & accepted) {
    if ((int) tried.size() != N_CELLS || (int) accepted.size() != N_CELLS) {
        throw std::invalid_argument("acceptance counts: expected " + std::to_string(N_CELLS) + " cells, got " +
                                    std::to_string(tried.size()) + " tried and " + std::to_string(accepted.size()) +
                                    " accepted");
    }
    for (int c = 0; c < N_CELLS; ++c) {
        if (!std::isfinite(tried[c]) || !std::isfinite(accepted[c]) || accepted[c] < 0.0 ||
            accepted[c] > tried[c] * (1.0 + 1e-9) + 1e-9) {
            throw std::invalid_argument("acceptance counts: cell " + std::to_string(c) + " has " +
                                        std::to_string(accepted[c]) + " accepted of " + std::to_string(tried[c]) +
                                        " tried");
        }
    }
    for (int c = 0; c < N_CELLS; ++c) {
        const double scale = tried[c] > RESTORED_TRIED ? RESTORED_TRIED / tried[c] : 1.0;
        tried_[c]          = tried[c] * scale;
        accepted_[c]       = std::min(accepted[c], tried[c]) * scale;
    }
}

}  // namespace pdf
