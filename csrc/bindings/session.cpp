// Session: a target's evaluation state (KV cache, recurrent state, prompt cache, compute buffers) over a
// Model, and its low-level calls (evaluate, commit, truncate); generation is bindings/generate.cpp
#include "bindings/common.h"
#include "state/session_batch.h"

#include <algorithm>
#include <cstring>

namespace pdf::bindings {

static std::unique_ptr<session> make_session(const py_model & m, int64_t n_ctx, const std::string & type_k,
                                             const std::string & type_v, int64_t n_ubatch, int64_t n_rollback) {
    session_params p;
    p.n_ctx      = (uint32_t) checked("n_ctx", n_ctx, 1, MAX_CTX);
    p.n_ubatch   = (uint32_t) checked("n_ubatch", n_ubatch, 1, MAX_CTX);
    p.n_rollback = (uint32_t) checked("n_rollback", n_rollback, 1, MAX_ROLLBACK);
    p.type_k     = parse_kv_type(type_k);
    p.type_v     = parse_kv_type(type_v);
    return std::make_unique<session>(m.model, p);
}

static std::vector<double> time_prefill(session & s, py::object tokens_in, std::vector<int> sizes, py_draft * draft,
                                        int64_t reps) {
    const std::vector<int32_t> tokens = int32_array("tokens", tokens_in);
    checked("reps", reps, 1, 100);
    py::gil_scoped_release nogil;
    if (draft) {
        const speculation spec = draft->with(draft->spec);
        return time_prefill_with(s, &spec, tokens, sizes, (int) reps);
    }
    return time_prefill_with(s, nullptr, tokens, sizes, (int) reps);
}

// an evaluation's shape as measure_eval and measure_batch take it, checked
static session_batch::shape eval_shape(session & s, int64_t n_tokens, int64_t n_kv, std::vector<int> tree_levels,
                                       bool whole, bool all_rows, bool logits, const py::object & draft) {
    checked("n_tokens", n_tokens, 1, (int64_t) s.n_ctx());
    if (n_kv == 0) {
        n_kv = s.n_ctx();
    }
    checked("n_kv", n_kv, n_tokens, (int64_t) s.n_ctx());
    int64_t in_levels = 0;
    for (int l : tree_levels) {
        checked("tree_levels entry", l, 1, n_tokens);
        in_levels += l;
    }
    if (!tree_levels.empty() && in_levels != n_tokens) {
        throw std::invalid_argument(format("tree_levels hold %lld nodes, n_tokens = %lld",
                                           (long long) in_levels, (long long) n_tokens));
    }
    session_batch::shape shape{&s, (int) n_tokens, (int) n_kv, std::move(tree_levels), whole, {all_rows, logits, 0}};
    if (!draft.is_none()) {
        py_draft & d = draft.cast<py_draft &>();
        shape.capture = d.session->model().capture_layers();
        shape.rings   = &d.session->ring();
    }
    return shape;
}

static size_t measure_eval(session & s, int64_t n_tokens, int64_t n_kv, std::vector<int> tree_levels, bool whole,
                           bool all_rows, bool logits, const py::object & draft) {
    const session_batch::shape e = eval_shape(s, n_tokens, n_kv, std::move(tree_levels), whole, all_rows, logits,
                                              draft);
    py::gil_scoped_release nogil;
    return s.measure_eval(e.n_tokens, e.n_kv, e.tree_levels, e.whole, e.what, e.capture, e.rings);
}

static size_t measure_batch(session & s, int64_t prompt_parts, int64_t verify_parts, int64_t n_ubatch, int64_t width,
                            std::vector<int> tree_levels, int64_t n_kv, const py::object & draft) {
    checked("prompt_parts", prompt_parts, 0, 1024);
    checked("verify_parts", verify_parts, 0, 1024);
    if (prompt_parts + verify_parts == 0) {
        throw std::invalid_argument("measure_batch: no parts");
    }
    std::vector<session_batch::shape> parts;
    for (int64_t i = 0; i < prompt_parts; ++i) {
        parts.push_back(eval_shape(s, n_ubatch, n_kv, {}, true, false, true, draft));
    }
    for (int64_t i = 0; i < verify_parts; ++i) {
        parts.push_back(eval_shape(s, width, n_kv, tree_levels, false, true, true, draft));
    }
    py::gil_scoped_release nogil;
    session_batch batch(s.shared_model());
    return batch.measure(parts);
}

// what an eval read back: logits, captured hidden states and (top_k > 0) the top ids and log-probabilities
py::tuple eval_result(const session & s, int n, const std::vector<int> & capture_layers, int64_t top_k,
                             bool read_logits) {
    const int64_t n_vocab = s.model().info().n_vocab, n_embd = s.model().info().n_embd;
    py::array_t<float> logits({(py::ssize_t) (read_logits ? s.n_outputs() : 0), (py::ssize_t) n_vocab});
    std::copy(s.logits().begin(), s.logits().end(), logits.mutable_data());
    py::list captured;
    for (size_t c = 0; c < capture_layers.size(); ++c) {
        py::array_t<float> h({(py::ssize_t) n, (py::ssize_t) n_embd});
        std::copy(s.captured(c).begin(), s.captured(c).end(), h.mutable_data());
        captured.append(h);
    }
    if (top_k > 0) {
        py::array_t<int32_t> ids({(int64_t) s.n_outputs(), top_k});
        py::array_t<float>   lps({(int64_t) s.n_outputs(), top_k});
        std::copy(s.top_ids().begin(), s.top_ids().end(), ids.mutable_data());
        std::copy(s.top_logprobs().begin(), s.top_logprobs().end(), lps.mutable_data());
        return py::make_tuple(logits, captured, ids, lps);
    }
    return py::make_tuple(logits, captured);
}

static py::tuple eval(session & s, py::object tokens_in, py::object positions, py::object mask, py::object parents,
                      bool all_logits, std::vector<int> capture_layers, int64_t top_k, bool read_logits, bool whole) {
    const std::vector<int32_t> toks = int32_array("tokens", tokens_in);
    const int                  n    = (int) toks.size();
    checked("top_k", top_k, 0, INT32_MAX);
    const batch_arrays batch(n, positions, mask, parents);
    {
        py::gil_scoped_release nogil;
        s.eval(toks.data(), n, batch.layout(whole), readout{all_logits, read_logits, (int) top_k}, capture_layers);
    }
    return eval_result(s, n, capture_layers, top_k, read_logits);
}

static void register_memory(py::class_<session> & cls) {
    cls.def_property_readonly("kv_bytes", &session::kv_bytes)
        .def_property_readonly("recurrent_bytes", &session::recurrent_bytes)
        .def_property_readonly("kv_memory", [](const session & s) { return as_pair(s.kv_memory()); })
        .def_property_readonly("recurrent_memory", [](const session & s) { return as_pair(s.recurrent_memory()); })
        .def_property_readonly("compute_memory", [](const session & s) { return as_pair(s.compute_memory()); },
                               "(CPU bytes, GPU bytes) of the compute buffer its graphs share, as allocated so far.")
        .def_property_readonly("commit_compute_memory",
                               [](const session & s) { return as_pair(s.commit_compute_memory()); },
                               "(CPU bytes, GPU bytes) of the compute buffer in which a hybrid model's commits "
                               "recompute the kept tokens' recurrent state, as allocated so far.")
        .def("measure_commit", &session::measure_commit,
             "Compute buffer bytes of the largest commit graph (a hybrid model's recurrent state recomputed over "
             "n_rollback steps): ggml's allocator over its graph, nothing allocated; 0 without recurrent layers.")
        .def("measure_eval", &measure_eval,
            py::arg("n_tokens"), py::arg("n_kv") = 0, py::arg("tree_levels") = std::vector<int>{},
            py::arg("whole") = false,
            py::arg("all_rows") = true, py::arg("logits") = true, py::arg("draft") = py::none(),
            "Compute buffer bytes of an evaluation of n_tokens over a window of n_kv cache slots (0: the whole "
            "context; a chain, or a tree of tree_levels nodes per depth), capturing into `draft`'s ring as a "
            "speculative eval does: ggml's allocator over its graph, nothing allocated.")
        .def("measure_batch", &measure_batch, py::arg("prompt_parts"), py::arg("verify_parts"),
            py::arg("n_ubatch") = 1, py::arg("width") = 1, py::arg("tree_levels") = std::vector<int>{},
            py::arg("n_kv") = 0, py::arg("draft") = py::none(),
            "Compute buffer bytes of one batched evaluation (an EvalBatcher's step) of sessions of this one's "
            "configuration: prompt_parts prefill micro-batches of n_ubatch tokens and verify_parts verifies of width "
            "tokens (a chain, or a tree of tree_levels nodes per depth), each over n_kv cache slots (0: the whole "
            "context), capturing as measure_eval does.");
}

static void register_eval(py::class_<session> & cls) {
    cls.def("eval", &eval,
            py::arg("tokens"), py::arg("positions") = py::none(), py::arg("mask") = py::none(),
            py::arg("parents") = py::none(), py::arg("all_logits") = true,
            py::arg("capture_layers") = std::vector<int>{}, py::arg("top_k") = 0, py::arg("read_logits") = true,
            py::arg("whole") = false,
            "Evaluate tokens into cache slots n_past..; returns (logits [n_out, n_vocab], [hidden [n, n_embd] ...]) "
            "(and top_k ids, log-probabilities [n_out, top_k] when top_k > 0). parents: a tree (parent row per row, "
            "-1: the committed past); mask: any visibility (attention-only models). read_logits=False reads only "
            "the greedy picks (Session.argmax), as the decode loop does; the logits array is then empty. whole=True: "
            "the chain will be committed whole (a prefill), so a hybrid model keeps only its final state.")
        .def("commit", [](session & s, int64_t n) { s.commit((int) checked("n", n, 0, INT32_MAX)); }, py::arg("n"))
        .def("commit", py::overload_cast<const std::vector<int> &>(&session::commit), py::arg("rows"))
        .def("eval_slot", [](const session & s, int64_t row) {
                 if (s.n_pending() == 0) {
                     throw std::invalid_argument("eval_slot: no evaluation is pending");
                 }
                 return s.eval_slot((int) checked("row", row, 0, s.n_pending() - 1));
             }, py::arg("row"))
        .def("truncate", [](session & s, int64_t n_past) { s.truncate((int) checked("n_past", n_past, 0, INT32_MAX)); },
             py::arg("n_past"))
        .def("abort", [](session & s) { s.abort.store(true); });
}

// a traced node as numpy: int32 or float32, its shape ggml's reversed without the outer 1s beyond two dims
// ([k, n] -> (n, k), also for one token)
static py::array traced_array(const traced_node & n) {
    int dims = 4;
    while (dims > 2 && n.ne[dims - 1] == 1) {
        --dims;
    }
    std::vector<py::ssize_t> shape;
    for (int d = dims - 1; d >= 0; --d) {
        shape.push_back((py::ssize_t) n.ne[d]);
    }
    py::dtype dtype = n.type == GGML_TYPE_I32 ? py::dtype::of<int32_t>() : py::dtype::of<float>();
    if (n.type != GGML_TYPE_I32 && n.type != GGML_TYPE_F32) {
        throw std::invalid_argument(format("traced node of type %s: only f32 and i32 nodes are read back",
                                           ggml_type_name(n.type)));
    }
    py::array out(dtype, shape);
    std::memcpy(out.mutable_data(), n.data.data(), n.data.size());
    return out;
}

static void register_trace(py::class_<session> & cls) {
    cls.def("trace_nodes", [](session & s, const std::string & prefix) { s.compute()->trace_nodes(prefix); },
            py::arg("prefix"),
            "From now on copy the graph nodes whose names start with prefix as they compute (slower; '' stops), "
            "e.g. 'ffn_moe_topk-' for the experts each token was routed to, per layer.")
        .def("take_trace", [](const session & s) {
                 py::dict out;
                 for (const auto & [name, node] : s.compute()->take_trace()) {
                     out[py::str(name)] = traced_array(node);
                 }
                 return out;
             },
             "The traced nodes of the graphs computed since the last call, by name (numpy, outermost dim first).");
}

void register_session(py::module_ & m) {
    py::class_<session> cls(m, "Session");
    cls.def(py::init(&make_session), py::arg("model"), py::arg("n_ctx") = 4096, py::arg("type_k") = "f16",
            py::arg("type_v") = "f16", py::arg("n_ubatch") = 512, py::arg("n_rollback") = 16, py::keep_alive<1, 2>())
        .def_property_readonly("n_past", &session::n_past)
        .def_property_readonly("n_ctx", &session::n_ctx)
        .def_property_readonly("n_rollback", &session::n_rollback)
        .def_property("n_ubatch", &session::n_ubatch,
                      [](session & s, int64_t n) { s.set_n_ubatch((uint32_t) checked("n_ubatch", n, 1, MAX_CTX)); },
                      "The prefill micro-batch; setting it forgets the prompt cache's marks.")
        .def("time_prefill", &time_prefill,
            py::arg("tokens"), py::arg("sizes"), py::arg("draft") = nullptr, py::arg("reps") = 1,
            "Milliseconds per token of a prefill micro-batch of each size (evaluations of the first `size` tokens "
            "into an empty cache, as a prefill with `draft` capturing runs them); the session is left empty.")
        .def_property_readonly("kv_window_step", &session::kv_window_step,
                               "The attended window grows in steps of this many cache slots (one graph per step): "
                               "64 where the target computes on the CPU, 256 on a GPU.")
        .def_property_readonly("tokens", &session::tokens)
        .def_property_readonly("argmax", &session::argmax, "The greedy pick of each row read by the last eval.");
    register_memory(cls);
    register_eval(cls);
    register_trace(cls);
}

}  // namespace pdf::bindings
