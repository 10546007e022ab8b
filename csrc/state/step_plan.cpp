#include "state/step_plan.h"

#include <algorithm>
#include <queue>
#include <utility>

namespace pdf {

step_plan plan_step(const std::vector<const std::vector<double> *> & offers, const fixed_parts & fixed,
                    const step_times & times, int row_tile) {
    const int n_offers = (int) offers.size();
    const int parts    = fixed.parts + n_offers;
    const int roots    = fixed.rows + n_offers;  // every offer's root (its plain step)
    step_plan plan;
    if (times.estimate(parts, roots) <= 0) {
        return plan;
    }
    plan.plain_tokens = parts;  // every part's root
    // (a row per part: the step may run part by part, where that is cheaper)
    plan.plain_ms     = roots == parts ? times.plain_step(parts) : times.estimate(parts, roots);
    const int max_rows = std::max(2 * times.widest(parts), times.widest(parts) + 8);
    // every offer's next candidate, the most likely first
    std::priority_queue<std::pair<double, int>> next;
    std::vector<int>                            taken(n_offers, 0);
    for (int i = 0; i < n_offers; ++i) {
        if (!offers[i]->empty()) {
            next.push({(*offers[i])[0], i});
        }
    }
    std::vector<int> order;  // the offer each successive candidate belongs to
    double           tokens    = plan.plain_tokens;
    double           best_rate = tokens / plan.plain_ms;
    int              best_x    = 0;
    plan.tokens                = plan.plain_tokens;
    plan.ms                    = plan.plain_ms;
    while (!next.empty() && roots + (int) order.size() < max_rows) {
        const auto [gain, i] = next.top();
        next.pop();
        order.push_back(i);
        tokens += gain;
        if (++taken[i] < (int) offers[i]->size()) {
            next.push({(*offers[i])[taken[i]], i});
        }
        const int rows = roots + (int) order.size();
        if (rows % row_tile != 0 && !next.empty()) {
            continue;  // (the next candidates fill the tile at little cost)
        }
        const double ms = times.estimate(parts, rows);
        if (tokens / ms > best_rate) {
            best_rate   = tokens / ms;
            best_x      = (int) order.size();
            plan.tokens = tokens;
            plan.ms     = ms;
        }
    }
    plan.widths.assign(n_offers, 0);
    for (int x = 0; x < best_x; ++x) {
        plan.widths[order[x]]++;
    }
    return plan;
}

}  // namespace pdf
