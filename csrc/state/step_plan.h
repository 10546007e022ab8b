// The batch's choice of what each generation verifies in a step (the cost model deciding for the batch): every
// generation running auto offers its round's candidate tree, best first, with the probability that the target's
// accepted path reaches each node; the plan gives each offer a prefix of its tree to verify, so that the step's
// expected committed tokens per ms of its time (state/step_times.h) is the highest. The candidates are taken in
// one order across the offers, the most likely first (the expected tokens of a prefix of each tree are concave in
// its length, so this order gives, for every total of rows, the most tokens); the total is where the step's rate
// peaks, the measured times of every total included (a step of 12 rows can cost less than one of 11). Plain
// decoding for everyone is the total 0: the batch finds out itself when speculation does not pay.
#pragma once

#include "state/step_times.h"

#include <vector>

namespace pdf {

// the step's decoding parts that offer nothing (plain rounds, chain and tree modes' verifies): each commits at
// least its root's token. (A prompt micro-batch in the step is left out of its plan: the plan is what a step of
// the decoding parts alone would verify.)
struct fixed_parts {
    int parts = 0;
    int rows  = 0;
};

// the plan: per offer, how many of its nodes below the root to verify (empty: no step of this many parts has
// been measured yet; each generation then decides alone), with the step's expected committed tokens and
// estimated ms, and the same for plain decoding (every offer cut to its root)
struct step_plan {
    std::vector<int> widths;
    double           tokens = 0.0, ms = 0.0, plain_tokens = 0.0, plain_ms = 0.0;
};

// offers[i][b]: P(the accepted path of generation i reaches node b+1 of its tree), in the tree's order (every
// prefix a tree); times: steps of decoding parts only. A speculative step's rows in all are a whole number of
// row_tile (the target's, models/model.h verify_row_tile), or every candidate offered (plain decoding, a row per
// part, is a choice whatever its rows). Rows beyond what was measured are explored at most up to twice the widest
// measured (and 8 more): a wrong guess costs one bounded step.
step_plan plan_step(const std::vector<const std::vector<double> *> & offers, const fixed_parts & fixed,
                    const step_times & times, int row_tile = 1);

}  // namespace pdf
