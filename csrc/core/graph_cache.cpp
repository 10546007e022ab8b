#include "core/graph_cache.h"
#include "core/error.h"

#include <algorithm>
#include <atomic>

namespace pdf {

static std::atomic<uint64_t> n_builds{0}, n_placements{0};
static std::atomic<int64_t>  n_kept_graphs{0}, n_kept_bytes{0};

graph_counts graph_counters() {
    return {n_builds.load(), n_placements.load()};
}

kept_graphs kept_graph_memory() {
    return {n_kept_graphs.load(), n_kept_bytes.load()};
}

void graph_cache::count_kept() {
    // capacities, not sizes: a place rebuilt for a smaller graph keeps the larger one's allocation
    const size_t now = built_ ? meta_.capacity() + sources_.capacity() * sizeof(ggml_tensor *) : 0;
    n_kept_graphs += (now > 0) - (counted_bytes_ > 0);
    n_kept_bytes += (int64_t) now - (int64_t) counted_bytes_;
    counted_bytes_ = now;
}

graph_arena::graph_arena(const compute_backends & compute) : compute_(compute) {}

graph_arena::~graph_arena() {
    if (sched_) {
        ggml_backend_sched_free(sched_);
    }
}

ggml_backend_sched_t graph_arena::sched_for(size_t n_nodes) {
    // the scheduler's hash set is sized for its largest graph
    if (!sched_ || n_nodes > sched_nodes_) {
        if (sched_) {
            ggml_backend_sched_free(sched_);
        }
        resident_    = nullptr;
        sched_       = compute_.new_sched(n_nodes);
        sched_nodes_ = n_nodes;
        if (!sched_) {
            throw backend_error("could not create the backend scheduler");
        }
    }
    return sched_;
}

void graph_arena::release() {
    if (sched_) {
        ggml_backend_sched_free(sched_);
        sched_ = nullptr;
        sched_for(sched_nodes_);  // for graphs as large as before, its buffer still empty
    }
}

ggml_status graph_arena::compute(ggml_cgraph * gf, size_t n_nodes) {
    return compute_.compute(sched_for(n_nodes), gf);
}

size_t graph_arena::bytes(ggml_backend_t backend) const {
    return sched_ && backend ? ggml_backend_sched_get_buffer_size(sched_, backend) : 0;
}

device_bytes graph_arena::memory() const {
    device_bytes n;
    n.cpu = bytes(compute_.cpu());
    for (ggml_backend_t gpu : compute_.gpus()) {
        n.gpu += bytes(gpu);
    }
    return n;
}

graph_cache::graph_cache(graph_arena & arena) : arena_(arena) {}

graph_cache::~graph_cache() {
    if (arena_.resident() == this) {
        arena_.set_resident(nullptr);
    }
    if (ctx_) {
        ggml_free(ctx_);
    }
    built_ = false;
    count_kept();
}

ggml_context * graph_cache::begin(size_t n_nodes) {
    built_ = false;
    if (arena_.resident() == this) {
        arena_.set_resident(nullptr);
    }
    if (ctx_) {
        ggml_free(ctx_);
        ctx_ = nullptr;
    }
    n_nodes_ = n_nodes;
    ++n_builds;
    sources_.clear();
    meta_.resize(ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false));
    ggml_init_params params = {meta_.size(), meta_.data(), true};
    ctx_                    = ggml_init(params);
    gf_                     = ggml_new_graph_custom(ctx_, n_nodes, false);
    built_                  = true;
    count_kept();
    return ctx_;
}

void graph_cache::clear_placement() {
    // the graph's own tensors (made in ctx_) lose their places; weights, caches and state, made elsewhere, keep
    // theirs. ggml's allocator places a tensor with no data, and re-derives a view's data when its buffer is unset.
    for (ggml_tensor * t = ggml_get_first_tensor(ctx_); t; t = ggml_get_next_tensor(ctx_, t)) {
        t->data   = nullptr;
        t->buffer = nullptr;
    }
}

void graph_cache::reset_sources() {
    const int n = ggml_graph_n_nodes(gf_);
    if (sources_.empty()) {
        sources_.resize((size_t) n * GGML_MAX_SRC);
        for (int i = 0; i < n; ++i) {
            std::copy_n(ggml_graph_node(gf_, i)->src, GGML_MAX_SRC, sources_.begin() + (size_t) i * GGML_MAX_SRC);
        }
        count_kept();
        return;
    }
    GGML_ASSERT(sources_.size() == (size_t) n * GGML_MAX_SRC);
    for (int i = 0; i < n; ++i) {
        std::copy_n(sources_.begin() + (size_t) i * GGML_MAX_SRC, GGML_MAX_SRC, ggml_graph_node(gf_, i)->src);
    }
}

void graph_cache::allocate(const char * what) {
    if (arena_.resident() == this) {
        return;
    }
    ggml_backend_sched_t sched = arena_.sched_for(n_nodes_);
    clear_placement();
    reset_sources();
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf_)) {
        arena_.set_resident(nullptr);
        throw backend_error(format("could not allocate %s", what));
    }
    ++n_placements;
    arena_.set_resident(this);
}

void graph_cache::compute(const char * what) {
    GGML_ASSERT(arena_.resident() == this);
    if (arena_.compute(gf_, n_nodes_) != GGML_STATUS_SUCCESS) {
        throw backend_error(format("%s: computation failed", what));
    }
}

size_t graph_cache::measure() {
    ggml_backend_sched_t sched = arena_.sched_for(n_nodes_);
    arena_.set_resident(nullptr);  // the scheduler's state is this measurement's now: the next graph re-allocates
    clear_placement();
    reset_sources();
    std::vector<size_t> sizes(ggml_backend_sched_get_n_backends(sched), 0);
    ggml_backend_sched_reserve_size(sched, gf_, sizes.data());
    ggml_backend_sched_reset(sched);
    size_t total = 0;
    for (size_t s : sizes) {
        total += s;
    }
    return total;
}

}  // namespace pdf
