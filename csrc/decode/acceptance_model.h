// How likely the target is to accept a drafted token, learnt online from the rounds verified so far. A node of
// a draft tree is "tried" when its parent was accepted; it is accepted when the target's pick after the parent
// is its token (sampling: it is accepted with the probability that the target's draw gives its token, which
// is what is counted, exactly, rather than the one draw's outcome). The drafter's own probability for the token (its per-position marginal, from one forward) is
// informative but not calibrated: at depth d it averages over the uncertain tokens before it, while the
// target only ever tries it after an accepted prefix. So the acceptance probability is kept per cell of
// (depth group, rank group, drafter probability bin), as decayed counts with a prior that trusts the drafter.
#pragma once

#include <utility>
#include <vector>

namespace pdf {

class acceptance_model {
  public:
    // P(accepted | parent accepted) of a node at `depth` (1-based) with the drafter's rank and probability
    double p_accept(int depth, int rank, double q) const;
    // a verified node whose parent was accepted: the probability that it was accepted too (0 or 1 when the target
    // decodes greedily)
    void observe(int depth, int rank, double q, double accepted);
    // the decayed (tried, accepted) counts of the cells of `depth` and `rank`, summed over the drafter's
    // probability bins
    std::pair<double, double> observed(int depth, int rank) const;
    // whether it has tried enough nodes to stand for what the target accepts: before, p_accept is mostly its
    // prior, the drafter's own probabilities, which a drafter can overstate at first
    bool                      learnt() const;

    // Kept across processes (pydflash/cost_cache.py): every cell's decayed (tried, accepted) counts, in one
    // order, and a table saved so. A restored cell keeps its rate but counts at most RESTORED_TRIED trials, so
    // that a few dozen rounds of the new conversation outweigh the old ones. Throws std::invalid_argument for
    // a table this model cannot hold (its length, a negative or non-finite count, more accepted than tried).
    static constexpr int      N_CELLS        = 80;
    static constexpr double   RESTORED_TRIED = 32.0;
    std::pair<std::vector<double>, std::vector<double>> counts() const { return {tried_, accepted_}; }
    void restore(const std::vector<double> & tried, const std::vector<double> & accepted);

  private:
    static constexpr int N_DEPTH = 4;   // depths 1, 2-3, 4-7, 8+
    static constexpr int N_RANK  = 2;   // the drafter's first choice, the others
    static constexpr int N_BINS  = 10;  // drafter probability in tenths
    static int    cell(int depth, int rank, double q);
    static double bin_centre(int cell);

    static_assert(N_DEPTH * N_RANK * N_BINS == N_CELLS);
    std::vector<double> tried_    = std::vector<double>(N_CELLS, 0.0);
    std::vector<double> accepted_ = std::vector<double>(N_CELLS, 0.0);
};

}  // namespace pdf
