// One compute graph of a session, rebuilt only when what it computes changes: the tensor metadata live in a
// host buffer of its own, the compute buffer in a scheduler over the session's own backends. The target and
// draft sessions each keep one and decide, by comparing their own keys, when to rebuild.
//
//   if (!cache.ready() || key != old_key) {
//       ggml_context * ctx = cache.begin(n_nodes);  // a fresh, empty graph
//       ... build into ctx / cache.graph() ...
//       cache.allocate("the draft graph");
//   }
//   ... set inputs ...
//   cache.compute("the draft graph");
#pragma once

#include "core/backend.h"

#include <cstdint>
#include <vector>

namespace pdf {

class graph_cache {
  public:
    explicit graph_cache(const compute_backends & compute);
    ~graph_cache();
    graph_cache(const graph_cache &)             = delete;
    graph_cache & operator=(const graph_cache &) = delete;

    // drops the current graph and starts an empty one of at most n_nodes nodes
    ggml_context * begin(size_t n_nodes);
    ggml_cgraph *  graph() const { return gf_; }
    // allocates the compute buffer of the graph built since begin(); throws backend_error naming `what`
    void allocate(const char * what);
    // runs it; throws backend_error naming `what`
    void compute(const char * what);
    bool ready() const { return ready_; }

  private:
    const compute_backends & compute_;
    ggml_backend_sched_t sched_       = nullptr;
    size_t               sched_nodes_ = 0;  // graph size the scheduler was made for
    ggml_context *       ctx_         = nullptr;
    ggml_cgraph *        gf_          = nullptr;
    std::vector<uint8_t> meta_;
    bool                 ready_ = false;
};

}  // namespace pdf
