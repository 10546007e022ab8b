// The compute graphs of a session: each built once and kept (graph_cache) until what it computes changes, all
// sharing ONE compute buffer (graph_arena) that holds the intermediate tensors of whichever graph was made
// resident last. A session keeps several graphs (prefill micro-batch, verify widths, tree shapes); were each
// allocated apart, its compute memory would be the sum over them (8 verify graphs over a 128K window on a GPU);
// shared, it is the largest one's, which is what the memory planner reserves. Switching graphs re-plans the
// allocation (ggml's allocator over the graph, ~0.1 ms on a 0.6B model) and keeps the built graph.
//
//   graph_arena arena(compute);  // one per session
//   graph_cache cache(arena);
//   if (!cache.ready() || key != old_key) {
//       ggml_context * ctx = cache.begin(n_nodes);  // a fresh, empty graph
//       ... build into ctx / cache.graph() ...
//   }
//   cache.allocate("the draft graph");              // resident (a no-op when it already is)
//   ... set inputs ...
//   cache.compute("the draft graph");
#pragma once

#include "core/backend.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace pdf {

class graph_arena {
  public:
    explicit graph_arena(const compute_backends & compute);
    ~graph_arena();
    graph_arena(const graph_arena &)             = delete;
    graph_arena & operator=(const graph_arena &) = delete;

    // the scheduler, made for graphs of at least n_nodes nodes (a larger graph needs a new one: nothing is
    // resident after that)
    ggml_backend_sched_t sched_for(size_t n_nodes);
    // frees the compute buffer (it regrows to the next graphs' needs; a buffer only ever grows otherwise): after
    // the largest graphs a session will run have changed (a smaller prefill micro-batch)
    void                 release();
    // which graph is allocated now (an opaque owner; nullptr: none)
    const void *         resident() const { return resident_; }
    void                 set_resident(const void * owner) { resident_ = owner; }
    // compute buffer bytes by backend: the CPU's, the GPU's
    device_bytes         memory() const;
    // runs a resident graph of at most n_nodes nodes (compute_backends::compute: in the session's turn)
    ggml_status          compute(ggml_cgraph * gf, size_t n_nodes);

  private:
    size_t bytes(ggml_backend_t backend) const;

    const compute_backends & compute_;
    ggml_backend_sched_t     sched_       = nullptr;
    size_t                   sched_nodes_ = 0;
    const void *             resident_    = nullptr;
};

class graph_cache {
  public:
    explicit graph_cache(graph_arena & arena);
    ~graph_cache();
    graph_cache(const graph_cache &)             = delete;
    graph_cache & operator=(const graph_cache &) = delete;

    // drops the current graph and starts an empty one of at most n_nodes nodes
    ggml_context * begin(size_t n_nodes);
    ggml_cgraph *  graph() const { return gf_; }
    // makes the graph built since begin() the arena's resident one (tensors placed in the compute buffer);
    // throws backend_error naming `what`. Inputs are set after this, before compute().
    void allocate(const char * what);
    // runs it (it must be resident); throws backend_error naming `what`
    void compute(const char * what);
    // compute buffer bytes the graph needs (all backends), measured by ggml's allocator without allocating
    size_t measure();
    bool ready() const { return built_; }

  private:
    // forgets where the graph's own tensors were placed (the buffer now holds another graph's)
    void clear_placement();
    // ggml's scheduler points a node's sources at copies it makes in its own context when they live on another
    // backend (a GPU split reading a CPU tensor), and remakes that context at every allocation: a kept graph made
    // resident again must start from the sources it was built with, or it reads another graph's copies (a CUDA
    // get_rows with garbage indices; the same through an RPC device). The first allocation saves them.
    void reset_sources();

    graph_arena &        arena_;
    size_t               n_nodes_ = 0;
    ggml_context *       ctx_     = nullptr;
    ggml_cgraph *        gf_      = nullptr;
    std::vector<uint8_t> meta_;
    bool                 built_ = false;
    // every node's sources as built (n_nodes x GGML_MAX_SRC), empty until the first allocation
    std::vector<ggml_tensor *> sources_;
    // what this graph adds to kept_graph_memory() now (updated by count_kept())
    size_t counted_bytes_ = 0;
    void   count_kept();
};

// The kept entry (T with a graph_cache, keys and a last_use) built for `keys`, now last used at `use`; nullptr:
// none is
template <class T, class Keys>
T * kept_graph(std::vector<std::unique_ptr<T>> & entries, const Keys & keys, uint64_t use) {
    for (auto & e : entries) {
        if (e->cache.ready() && e->keys == keys) {
            e->last_use = use;
            return e.get();
        }
    }
    return nullptr;
}

// A batch's parts in one order whatever order they come in (by their sessions' ids, id_of(part)): a graph is
// kept per order of its sessions, and the batcher's members hand in their parts in the order their threads reach
// the step (at N = 4 decoding streams, a target batch graph was made resident at 178 of 191 steps, built at 40)
template <class Part, class Id>
std::vector<Part> in_session_order(std::vector<Part> parts, Id id_of) {
    std::sort(parts.begin(), parts.end(), [&](const Part & a, const Part & b) { return id_of(a) < id_of(b); });
    return parts;
}

// Where a newly built graph goes among a bounded set of kept ones (entries: T with a graph_cache and a last_use):
// a new entry made by make() while there are fewer than max_entries, else the least recently used one
template <class T, class Make>
T & entry_for_new_graph(std::vector<std::unique_ptr<T>> & entries, size_t max_entries, Make make) {
    if (entries.size() < max_entries) {
        entries.push_back(make());
        return *entries.back();
    }
    return **std::min_element(entries.begin(), entries.end(),
                              [](const auto & a, const auto & b) { return a->last_use < b->last_use; });
}

// how many graphs were built and made resident (placed in their arena), process-wide: what switching between
// graphs costs is a rebuild or a re-placement each, and on a GPU a re-captured CUDA graph (benchmarks read these)
struct graph_counts {
    uint64_t builds     = 0;
    uint64_t placements = 0;
};
graph_counts graph_counters();

// host memory the graphs built and kept hold, process-wide: their nodes' metadata (160-270 KiB a graph for the
// tiny test pairs) and saved sources. Bounded by each owner's number of kept graphs, it grows as new shapes meet
// empty places in those caches (resident-memory soaks read it beside the compute buffers)
struct kept_graphs {
    int64_t graphs = 0;
    int64_t bytes  = 0;
};
kept_graphs kept_graph_memory();

// copies `size` bytes into graph input t at `offset` once its graph is resident; an input the graph does not
// read (positions and masks of a model with no attention layer) got no buffer and is skipped
inline void set_graph_input(ggml_tensor * t, const void * data, size_t offset, size_t size) {
    if (t->buffer) {
        ggml_backend_tensor_set(t, data, offset, size);
    }
}

}  // namespace pdf
