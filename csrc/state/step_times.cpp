#include "state/step_times.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace pdf {

// weight of a step's time in the running average at its shape: recent steps dominate (contexts grow)
static constexpr double AVERAGE_WEIGHT = 0.2;
// a step slower than this many times the average so far is a stall (the machine busy elsewhere): it moves the
// average as if it had taken this much
static constexpr double STALL_BOUND = 2.0;

double step_times::by_rows::estimate(int rows) const {
    const int n  = (int) ms.size();
    int       lo = -1, hi = -1;  // the nearest measured row counts at or below rows, and at or above
    for (int r = std::min(rows, n - 1); r >= 1 && lo < 0; --r) {
        lo = ms[r] > 0 ? r : -1;
    }
    for (int r = std::max(rows, 1); r < n && hi < 0; ++r) {
        hi = ms[r] > 0 ? r : -1;
    }
    if (lo > 0 && hi > 0) {
        return lo == hi ? ms[lo] : ms[lo] + (ms[hi] - ms[lo]) * double(rows - lo) / double(hi - lo);
    }
    if (hi > 0) {
        return ms[hi] * rows / hi;
    }
    return lo > 0 ? ms[lo] : -1.0;
}

void step_times::by_rows::observe(int rows, double t) {
    if (rows >= (int) ms.size()) {
        ms.resize(rows + 1, 0.0);
        seen.resize(rows + 1, 0);
    }
    double & m = ms[rows];
    // the first step of a shape also builds its graph: the faster of the first two is the time, then an average
    if (seen[rows] == 0) {
        m = t;
    } else if (seen[rows] == 1) {
        m = std::min(m, t);
    } else {
        m += AVERAGE_WEIGHT * (std::min(t, STALL_BOUND * m) - m);
    }
    seen[rows] = std::min(seen[rows] + 1, 2);
}

int step_times::by_rows::widest() const {
    for (int r = (int) ms.size() - 1; r >= 1; --r) {
        if (ms[r] > 0) {
            return r;
        }
    }
    return 0;
}

int step_times::widest(int parts) const {
    const auto it = by_parts_.find(parts);
    return it == by_parts_.end() ? 0 : it->second.widest();
}

double step_times::estimate(int parts, int rows) const {
    const auto it = by_parts_.find(parts);
    return it == by_parts_.end() ? -1.0 : it->second.estimate(rows);
}

double step_times::settled(int parts, int rows) const {
    const auto it = by_parts_.find(parts);
    if (it == by_parts_.end() || rows >= (int) it->second.ms.size() || it->second.seen[rows] < 2) {
        return -1.0;
    }
    return it->second.ms[rows];
}

double step_times::plain_step(int parts) const {
    const double together = estimate(parts, parts), alone = settled(1, 1);
    if (alone <= 0 || parts < 2) {
        return together;
    }
    return together > 0 ? std::min(together, parts * alone) : parts * alone;
}

std::vector<double> step_times::split(const std::vector<int> & rows, double ms, bool learn) {
    const int P = (int) rows.size();
    int       R = 0;
    for (int n : rows) {
        R += n;
    }
    std::vector<double> share(P, ms / std::max(1, P));
    if (R > P) {
        // what the step would have cost with a row per part (in proportion to the rows until that is known)
        const double known = estimate(P, P);
        const double base  = std::clamp(known > 0 ? known : ms * P / R, 0.0, ms);
        for (int i = 0; i < P; ++i) {
            share[i] = base / P + (ms - base) * (rows[i] - 1) / (R - P);
        }
    }
    if (learn && ms > 0 && R > 0) {
        by_parts_[P].observe(R, ms);
    }
    return share;
}

std::map<int, std::map<int, double>> step_times::measured() const {
    std::map<int, std::map<int, double>> table;
    for (const auto & [parts, by] : by_parts_) {
        for (int rows = 1; rows < (int) by.ms.size(); ++rows) {
            if (by.seen[rows] > 0) {
                table[parts][rows] = by.ms[rows];
            }
        }
    }
    return table;
}

int step_times::shapes() const {
    int n = 0;
    for (const auto & [parts, by] : by_parts_) {
        n += (int) std::count_if(by.seen.begin(), by.seen.end(), [](int seen) { return seen > 0; });
    }
    return n;
}

void step_times::restore(const std::map<int, std::map<int, double>> & table) {
    for (const auto & [parts, by] : table) {
        for (const auto & [rows, ms] : by) {
            if (parts < 1 || rows < parts || rows > MAX_ROWS || !std::isfinite(ms) || ms <= 0.0) {
                throw std::invalid_argument("step times: a step of " + std::to_string(parts) + " parts and " +
                                            std::to_string(rows) + " rows taking " + std::to_string(ms) +
                                            " ms (expected 1 <= parts <= rows <= " + std::to_string(MAX_ROWS) +
                                            " and a positive time)");
            }
        }
    }
    for (const auto & [parts, by] : table) {
        by_rows & mine = by_parts_[parts];
        for (const auto & [rows, ms] : by) {
            mine.observe(rows, ms);
            mine.seen[rows] = 2;  // (averaged from here on: a restored time is no graph-building first step)
        }
    }
}

}  // namespace pdf
