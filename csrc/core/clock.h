// Wall-clock intervals for the decode loop's timings and auto's cost measurements.
#pragma once

#include <chrono>

namespace pdf {

using clock_type = std::chrono::steady_clock;

inline double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

}  // namespace pdf
