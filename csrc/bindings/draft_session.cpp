// DraftSession: a DFlash drafter for one target session (its context cache and the feature ring the target
// captures into), how it speculates, and what the decode loop learns about it
#include "bindings/common.h"
#include "state/draft_batch.h"

namespace pdf::bindings {

// the target a drafter reads: a Model, or a Session whose backends and thread pool the drafter then shares
static std::shared_ptr<const target_model> target_of(const py::object & target_arg,
                                                     std::shared_ptr<compute_backends> & compute) {
    if (py::isinstance<session>(target_arg)) {
        const session & s = target_arg.cast<const session &>();
        compute           = s.compute();
        return s.shared_model();
    }
    if (py::isinstance<py_model>(target_arg)) {
        return target_arg.cast<const py_model &>().model;
    }
    throw py::type_error(format("target must be a Model or a Session, got %s", type_name(target_arg).c_str()));
}

// the drafter's weights: a DraftModel loaded for `target`, or a path to load them from
static std::shared_ptr<const dflash_draft> draft_weights(const py::object & weights,
                                                         const std::shared_ptr<const target_model> & target) {
    if (py::isinstance<py_draft_model>(weights)) {
        std::shared_ptr<const dflash_draft> draft = weights.cast<const py_draft_model &>().model;
        if (&draft->target() != target.get()) {
            throw std::invalid_argument("the DraftModel was loaded for another target Model");
        }
        return draft;
    }
    if (py::isinstance<py::str>(weights)) {
        const std::string path = weights.cast<std::string>();
        py::gil_scoped_release nogil;
        return std::make_shared<dflash_draft>(path, target);
    }
    throw py::type_error(format("draft must be a path (str) or a DraftModel, got %s", type_name(weights).c_str()));
}

static py_draft make_draft_session(const py::object & target_arg, const py::object & weights, int64_t n_ctx,
                                   int64_t block_size, int64_t window, int64_t ring_capacity, int64_t top_k,
                                   bool with_logprobs, int64_t max_verify, const std::string & mode,
                                   int64_t tree_budget, const std::string & seed, const std::string & dflash2_tree) {
    std::shared_ptr<compute_backends>         compute;
    const std::shared_ptr<const target_model> target = target_of(target_arg, compute);
    draft_params params;
    checked("n_ctx", n_ctx, 1, MAX_CTX);
    params.block         = (int) checked("block_size", block_size, 0, dflash_draft::MAX_BLOCK_SIZE);
    params.window        = (int) checked("window", window, 1, INT32_MAX);
    params.ring_capacity = (int) checked("ring_capacity", ring_capacity, 1, INT32_MAX);
    params.top_k         = (int) checked("top_k", top_k, 1, INT32_MAX);
    params.with_logprobs = with_logprobs;
    if (dflash2_tree == "per_node" || dflash2_tree == "path" || dflash2_tree == "unary") {
        params.dflash2_tree = dflash2_tree == "per_node" ? selector_tree::per_node
                              : dflash2_tree == "path"   ? selector_tree::path
                                                         : selector_tree::unary;
    } else {
        throw std::invalid_argument(format("dflash2_tree = '%s' is not one of per_node, path, unary",
                                           dflash2_tree.c_str()));
    }
    checked("max_verify", max_verify, 0, INT32_MAX);
    py_draft d;
    d.spec.mode        = parse_spec_mode(mode);
    d.spec.tree_budget = tree_budget_arg(tree_budget);
    d.spec.seed        = parse_tree_seed(seed);
    d.session = std::make_unique<draft_session>(draft_weights(weights, target), (uint32_t) n_ctx, params, compute);
    const int ring_rows = d.session->ring().capacity();
    max_verify          = verify_width_cap((int) max_verify, ring_rows);
    if (max_verify < 1 || max_verify > ring_rows) {
        throw std::invalid_argument(format("max_verify = %lld must be in [1, %d] (the feature ring's rows)",
                                           (long long) max_verify, ring_rows));
    }
    d.state = std::make_unique<speculation_state>((int) max_verify);
    return d;
}

static void register_memory(py::class_<py_draft> & cls) {
    cls.def_property_readonly("weight_bytes", [](const py_draft & d) { return d.session->model().weight_bytes(); })
        .def_property_readonly("kv_bytes", [](const py_draft & d) { return d.session->kv_bytes(); })
        .def_property_readonly("ring_capacity", [](py_draft & d) { return d.session->ring().capacity(); })
        .def_property_readonly("ring_bytes", [](py_draft & d) { return d.session->ring().n_bytes(); })
        .def_property_readonly("kv_memory", [](const py_draft & d) { return as_pair(d.session->kv_memory()); })
        .def_property_readonly("ring_memory", [](const py_draft & d) { return as_pair(d.session->ring_memory()); })
        .def_property_readonly("compute_memory",
                               [](const py_draft & d) { return as_pair(d.session->compute_memory()); },
                               "(CPU bytes, GPU bytes) of the compute buffer its graphs share, as allocated so far.")
        .def("measure_compute", [](py_draft & d, int64_t n_rows, int64_t n_block, int64_t n_kv) {
                 return d.session->measure((int) checked("n_rows", n_rows, 0, INT32_MAX),
                                           (int) checked("n_block", n_block, 0, INT32_MAX),
                                           (int) checked("n_kv", n_kv, 0, INT32_MAX));
             }, py::arg("n_rows"), py::arg("n_block"), py::arg("n_kv"),
             "Compute buffer bytes of the graph appending n_rows context rows (0 or one of append_row_counts) and "
             "drafting n_block positions over n_kv cache slots (ggml's allocator; nothing allocated).")
        .def("measure_batch", [](py_draft & d, int64_t n_sessions, int64_t n_rows, int64_t n_block, int64_t n_kv) {
                 const std::vector<draft_session *> sessions((size_t) checked("n_sessions", n_sessions, 1, 1024),
                                                             d.session.get());
                 draft_batch batch(d.session->shared_model());
                 return batch.measure(sessions, (int) checked("n_rows", n_rows, 0, INT32_MAX),
                                      (int) checked("n_block", n_block, 1, INT32_MAX),
                                      (int) checked("n_kv", n_kv, 1, INT32_MAX));
             }, py::arg("n_sessions"), py::arg("n_rows"), py::arg("n_block"), py::arg("n_kv"),
             "Compute buffer bytes of one batched drafter graph (an EvalBatcher's) over n_sessions sessions of this "
             "one's configuration, each appending n_rows context rows and drafting n_block positions over n_kv "
             "cache slots (ggml's allocator; nothing allocated).")
        .def_property_readonly_static("append_row_counts",
                                      [](py::object) { return draft_session::append_row_counts(); })
        .def_property_readonly_static("window_step", [](py::object) { return draft_session::window_step(); })
        .def_property_readonly("n_slots", [](const py_draft & d) { return d.session->n_slots(); });
}

void register_draft_session(py::module_ & m) {
    py::class_<py_draft> cls(m, "DraftSession");
    cls.def(py::init(&make_draft_session), py::arg("target"), py::arg("draft"), py::arg("n_ctx"),
            py::arg("block_size") = 0, py::arg("window") = draft_params{}.window,
            py::arg("ring_capacity") = draft_params{}.ring_capacity, py::arg("top_k") = draft_params{}.top_k,
            py::arg("with_logprobs") = true, py::arg("max_verify") = 0, py::arg("spec_mode") = "chain",
            py::arg("tree_budget") = 0, py::arg("tree_seed") = "best_first", py::arg("dflash2_tree") = "per_node",
            py::keep_alive<1, 2>(),
            "spec_mode ('chain', 'tree' or 'auto'), tree_budget (0: the session's limit) and tree_seed: how its "
            "generations speculate, unless a generate call says otherwise. dflash2_tree: how a DFlash2 drafter's "
            "candidates rank in trees ('per_node': by the selector given each node's token; 'path': given the "
            "drafted path's; 'unary': by the drafter's logits, the path first).")
        .def_property_readonly("block_size", [](const py_draft & d) { return d.session->block(); })
        .def_property_readonly("trained_block_size", [](const py_draft & d) { return d.session->model().block_size(); })
        .def_property_readonly("mask_token", [](const py_draft & d) { return d.session->model().mask_token(); })
        .def_property_readonly("capture_layers", [](const py_draft & d) { return d.session->model().capture_layers(); })
        .def_property_readonly("window", [](const py_draft & d) { return d.session->window(); })
        .def_property_readonly("top_k", [](const py_draft & d) { return d.session->top_k(); })
        .def_property_readonly("tree_budget", [](const py_draft & d) { return d.spec.tree_budget; })
        .def("forget", [](py_draft & d) { d.session->truncate(0); },
             "Drop every context row: the target went on without this draft (plain decoding), so the rows no "
             "longer follow its history and a later prompt must not reuse them.");
    def_cost_model(
        cls, [](const py_draft & d) -> speculation_state & { return *d.state; },
        [](const py_draft & d) { return d.session->block(); },
        "The speculation cost model: measured verify times per width, draft time, rates (tokens/ms), and the "
        "acceptance of the drafter's first choice by depth when it gives it probability 0.5-0.6.",
        "Verify times (ms by grid width) measured earlier, as costs()['measured'] gave them, auto's cool-down "
        "length then (costs()['cool_len']; speculation not paying): it decodes plainly that many rounds before it "
        "next drafts; and what the target accepted then (costs()['acceptance'], (tried, accepted) counts: "
        "ValueError for counts of another shape), each cell's rate kept at the weight of a few dozen trials.");
    register_memory(cls);
}

}  // namespace pdf::bindings
