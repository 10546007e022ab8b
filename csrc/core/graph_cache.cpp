#include "core/graph_cache.h"
#include "core/error.h"

namespace pdf {

graph_cache::graph_cache(const compute_backends & compute) : compute_(compute) {}

graph_cache::~graph_cache() {
    if (sched_) {
        ggml_backend_sched_free(sched_);
    }
    if (ctx_) {
        ggml_free(ctx_);
    }
}

ggml_context * graph_cache::begin(size_t n_nodes) {
    ready_ = false;
    if (ctx_) {
        ggml_free(ctx_);
        ctx_ = nullptr;
    }
    // the scheduler's hash set is sized for its largest graph: a larger one needs a new scheduler
    if (!sched_ || n_nodes > sched_nodes_) {
        if (sched_) {
            ggml_backend_sched_free(sched_);
        }
        sched_       = compute_.new_sched(n_nodes);
        sched_nodes_ = n_nodes;
        if (!sched_) {
            throw backend_error("could not create the backend scheduler");
        }
    } else {
        ggml_backend_sched_reset(sched_);
    }
    meta_.resize(ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false));
    ggml_init_params params = {meta_.size(), meta_.data(), true};
    ctx_                    = ggml_init(params);
    gf_                     = ggml_new_graph_custom(ctx_, n_nodes, false);
    return ctx_;
}

void graph_cache::allocate(const char * what) {
    if (!ggml_backend_sched_alloc_graph(sched_, gf_)) {
        throw backend_error(format("could not allocate %s", what));
    }
    ready_ = true;
}

void graph_cache::compute(const char * what) {
    if (ggml_backend_sched_graph_compute(sched_, gf_) != GGML_STATUS_SUCCESS) {
        throw backend_error(format("%s: computation failed", what));
    }
}

}  // namespace pdf
