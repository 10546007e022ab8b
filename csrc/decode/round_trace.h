// Every round's width, time and graph churn, for benchmarks and diagnosis: what auto learns from (its cost model
// sees the same verify times) beside what each evaluation built or re-placed (core/graph_cache.h counters). Off
// unless a benchmark turns it on (the test hooks: pydflash._core.trace_rounds); process-wide, every stream's.
#pragma once

#include <cstdint>
#include <vector>

namespace pdf {

struct traced_round {
    int      width;       // tokens verified, the root included (1: a plain step)
    bool     tree;        // a recurrent target's branching tree graph
    bool     drafted;     // the proposer ran its drafter
    int      depth;       // positions past the root it drafted (proposer::drafted_depth)
    int      models;      // merged proposers: the models that drafted (proposer::drafted_models)
    bool     captured;    // the evaluation captured the proposer's features
    int      committed;   // tokens the round committed
    double   draft_ms;    // the proposal
    double   verify_ms;   // the evaluation and the walk down it
    uint64_t builds;      // graphs built during the evaluation (every session's, process-wide)
    uint64_t placements;  // graphs made resident during it
};

void                      set_round_tracing(bool on);
bool                      round_tracing();
void                      trace_round(const traced_round & r);
// the rounds traced since the last call, in order
std::vector<traced_round> take_traced_rounds();

}  // namespace pdf
