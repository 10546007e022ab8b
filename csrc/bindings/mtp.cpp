// MtpDrafter: the target's own multi-token-prediction head drafting for one target session
// (decode/mtp_proposer.h), what the decode loop learns about it kept across generate calls
#include "bindings/common.h"
#include "state/mtp_batch.h"

namespace pdf::bindings {

static py_mtp make_mtp(session & s, int64_t block_size, const std::string & mode, int64_t tree_budget, int64_t top_k,
                       int64_t max_verify) {
    py_mtp     m;
    mtp_params params;
    params.block       = (int) checked("block_size", block_size, 2, 64);
    m.spec.mode        = parse_spec_mode(mode);
    m.spec.tree_budget = tree_budget_arg(tree_budget);
    const bool chain   = m.spec.mode == spec_mode::chain;
    // 0: a chain's greedy pick, a tree's DRAFT_TOP_K candidates per position
    params.top_k = top_k == 0 ? (chain ? 1 : DRAFT_TOP_K) : (int) checked("top_k", top_k, 1, INT32_MAX);
    if (m.spec.mode == spec_mode::tree && params.top_k < 2) {
        throw std::invalid_argument("spec_mode = 'tree' builds trees of the head's candidates: top_k >= 2");
    }
    // a chain takes the greedy pick alone (no softmax over the vocabulary); trees weigh the head's probabilities
    params.with_logprobs = !chain || params.top_k > 1;
    const int budget     = m.spec.tree_budget > 0
                               ? m.spec.tree_budget
                               : default_mtp_tree_budget(s.model(), m.spec.mode, params.block, params.top_k);
    // the widest verify auto weighs (the root and its nodes), and the ring's rows: one target evaluation's (a
    // prefill micro-batch, a verify) and the state before them
    const int widest     = max_verify > 0 ? (int) checked("max_verify", max_verify, 1, MAX_TREE_BUDGET + 1)
                                          : 1 + budget;
    params.ring_capacity = std::max<int>((int) s.n_ubatch(), widest) + 1;
    const int kv_il      = s.model().info().kv_layers.at(0).il;  // (a Qwen3.5 target always has attention layers)
    params.type_k        = s.kv().k(kv_il)->type;
    params.type_v        = s.kv().v(kv_il)->type;
    m.head  = std::make_unique<mtp_session>(s.shared_model(), s.n_ctx(), params, s.compute());
    m.state = std::make_unique<speculation_state>(widest);
    return m;
}

// the head's drafts after `prompt` (a fresh prefill of the session): the target's next token and, for each of
// n_steps positions after it, the head's top_k candidates with their log-probabilities
static py::tuple draft_after(py_mtp & m, session & s, py::object prompt_in, int64_t n_steps) {
    const std::vector<int32_t> prompt = int32_array("prompt", prompt_in);
    checked("n_steps", n_steps, 1, m.head->block() - 1);
    if (prompt.empty() || prompt.size() + n_steps >= s.n_ctx()) {
        throw std::invalid_argument(format("draft_after: a prompt of 1 .. %lld tokens",
                                           (long long) (s.n_ctx() - 1 - n_steps)));
    }
    py::gil_scoped_release nogil;
    s.truncate(0);  // (a fresh prefill: the prompt cache is not reused)
    mtp_proposer     prop(s, *m.head, *m.state, m.spec);
    generate_timings t;
    prefill(s, prop, prompt, t);  // in micro-batches, the head's rows queued as a generation's are
    feature_ring & ring = m.head->ring();
    const int32_t           anchor = s.argmax().back();
    const int               L      = (int) prompt.size();
    const draft_proposals & d      = m.head->draft(anchor, L, ring.slot(L - 1), (int) n_steps);
    py::gil_scoped_acquire  gil;
    py::array_t<int32_t>    ids({d.n_positions, d.top_k});
    py::array_t<float>      lps({d.n_positions, d.top_k});
    // (the head keeps room for a whole block: its first n_steps positions only)
    const size_t n = (size_t) d.n_positions * d.top_k;
    std::copy_n(d.ids.begin(), n, ids.mutable_data());
    std::copy_n(d.logprobs.begin(), n, lps.mutable_data());
    return py::make_tuple(anchor, ids, lps);
}

void register_mtp(py::module_ & m) {
    py::class_<py_mtp> cls(m, "MtpDrafter");
    def_cost_model(
        cls, [](const py_mtp & g) -> speculation_state & { return *g.state; },
        [](const py_mtp & g) { return g.head->block(); },
        "The speculation cost model, as DraftSession.costs() (the head's first choice by depth).",
        "Verify times, auto's cool-down length and the acceptance counts measured earlier, as "
        "DraftSession.restore_costs().");
    cls.def(py::init(&make_mtp), py::arg("session"), py::arg("block_size") = 4, py::arg("spec_mode") = "auto",
             py::arg("tree_budget") = 0, py::arg("top_k") = 0, py::arg("max_verify") = 0,
             "The target's own multi-token-prediction head (a GGUF with nextn blocks) drafting for `session`: a "
             "chain of at most block_size - 1 tokens per round (spec_mode 'chain'), a best-first tree of its top_k "
             "candidates at those positions, at most tree_budget nodes ('tree'), or that tree cut by auto's cost "
             "model ('auto'). top_k 0: 1 for a chain, 8 for trees. Give it to Session.generate(mtp=...); one per "
             "session. A file without a head raises UnsupportedModelError naming what it lacks.")
        .def_property_readonly("block_size", [](const py_mtp & g) { return g.head->block(); })
        .def_property_readonly("spec_mode", [](const py_mtp & g) {
            return g.spec.mode == spec_mode::chain ? "chain" : g.spec.mode == spec_mode::tree ? "tree" : "auto";
        })
        .def_property_readonly("top_k", [](const py_mtp & g) { return g.head->top_k(); })
        .def_property_readonly("kv_memory", [](const py_mtp & g) { return as_pair(g.head->kv_memory()); })
        .def_property_readonly("ring_memory", [](const py_mtp & g) { return as_pair(g.head->ring_memory()); })
        .def_property_readonly("compute_memory", [](const py_mtp & g) { return as_pair(g.head->compute_memory()); })
        .def("measure_compute", [](py_mtp & g, int64_t n_kv) {
                 return g.head->measure((int) checked("n_kv", n_kv, 1, INT32_MAX));
             }, py::arg("n_kv"),
             "Compute buffer bytes of its largest graph over n_kv cache slots (ggml's allocator; nothing allocated).")
        .def("measure_batch", [](py_mtp & g, int64_t n_sessions, int64_t n_kv) {
                 const std::vector<mtp_session *> heads((size_t) checked("n_sessions", n_sessions, 1, 1024),
                                                        g.head.get());
                 const int   w = (int) checked("n_kv", n_kv, 1, INT32_MAX);
                 mtp_batch   batch(g.head->shared_target());
                 return std::max(batch.measure(heads, true, w), batch.measure(heads, false, w));
             }, py::arg("n_sessions"), py::arg("n_kv"),
             "Compute buffer bytes of the larger of the batched head graphs (an EvalBatcher's: step 0, a later step) "
             "over n_sessions heads of this one's configuration attending over n_kv cache slots (ggml's allocator; "
             "nothing allocated).")
        .def_property_readonly_static("window_step", [](py::object) { return mtp_session::window_step(); })
        .def("draft_after", &draft_after, py::arg("session"), py::arg("prompt"), py::arg("n_steps"),
             "(target's next token, ids [n_steps, top_k], log-probabilities [n_steps, top_k]): the head's drafts after "
             "a fresh prefill of prompt (for tests against a reference).");
}

}  // namespace pdf::bindings
