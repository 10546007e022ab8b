// Copies of chosen graph nodes as a graph computes, for inspection (the benchmarks read which experts each token
// of a verify was routed to from the `ffn_moe_topk-<layer>` nodes). Through ggml's scheduler eval callback: the
// scheduler then stops after each traced node to hand it over, so a traced compute is slower; nothing is traced
// unless asked.
#pragma once

#include "ggml-backend.h"

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace pdf {

struct traced_node {
    ggml_type              type;
    std::array<int64_t, 4> ne;
    std::vector<uint8_t>   data;  // contiguous, ne[0] innermost
};

class node_trace {
  public:
    // the nodes whose names start with `prefix` (not empty)
    explicit node_trace(std::string prefix) : prefix_(std::move(prefix)) {}

    // the traced nodes of the graphs computed since the last take, by name (a later graph's replaces an earlier
    // one's of the same name); emptied
    std::map<std::string, traced_node> take() { return std::move(nodes_); }

    // ggml_backend_sched_eval_callback: asked whether it wants `t` (ask), then given it once computed
    static bool observe(ggml_tensor * t, bool ask, void * user);

  private:
    std::string                        prefix_;
    std::map<std::string, traced_node> nodes_;
};

}  // namespace pdf
