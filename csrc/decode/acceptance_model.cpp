#include "decode/acceptance_model.h"

#include <algorithm>

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

}  // namespace pdf
