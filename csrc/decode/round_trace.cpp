#include "decode/round_trace.h"

#include <atomic>
#include <mutex>

namespace pdf {

static std::atomic<bool>         tracing{false};
static std::mutex                traced_mutex;
static std::vector<traced_round> traced;

void set_round_tracing(bool on) {
    tracing = on;
}

bool round_tracing() {
    return tracing.load(std::memory_order_relaxed);
}

void trace_round(const traced_round & r) {
    std::lock_guard<std::mutex> lock(traced_mutex);
    traced.push_back(r);
}

std::vector<traced_round> take_traced_rounds() {
    std::lock_guard<std::mutex> lock(traced_mutex);
    std::vector<traced_round>   out;
    out.swap(traced);
    return out;
}

}  // namespace pdf
