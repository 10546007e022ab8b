// SessionBatch: one target evaluation over several Sessions of one Model (state/session_batch.h), the
// low-level call under batched generation
#include "bindings/common.h"
#include "state/eval_batcher.h"
#include "state/session_batch.h"

namespace pdf::bindings {

namespace {
// one part as given from Python, kept alive while the batch evaluates
struct part_arrays {
    session *            s = nullptr;
    std::vector<int32_t> tokens;
    batch_arrays         layout;
    readout              what;
    bool                 whole = false;
    std::vector<int>     capture;
};

const char * const PART_KEYS[] = {"session", "tokens", "positions", "mask", "parents", "all_logits", "read_logits",
                                  "top_k", "whole", "capture_layers"};

part_arrays read_part(size_t i, const py::dict & d) {
    for (auto item : d) {
        const std::string key = py::str(item.first);
        if (std::find(std::begin(PART_KEYS), std::end(PART_KEYS), key) == std::end(PART_KEYS)) {
            throw std::invalid_argument(format("SessionBatch.eval: part %zu has an unknown key '%s'", i, key.c_str()));
        }
    }
    if (!d.contains("session") || !d.contains("tokens")) {
        throw std::invalid_argument(format("SessionBatch.eval: part %zu needs 'session' and 'tokens'", i));
    }
    auto get = [&](const char * k) { return d.contains(k) ? py::object(d[k]) : py::object(py::none()); };
    std::vector<int32_t> tokens = int32_array("tokens", d["tokens"]);
    const int            n      = (int) tokens.size();
    part_arrays p{&d["session"].cast<session &>(), std::move(tokens),
                  batch_arrays(n, get("positions"), get("mask"), get("parents"))};
    const int64_t top_k = d.contains("top_k") ? checked("top_k", d["top_k"].cast<int64_t>(), 0, INT32_MAX) : 0;
    p.what    = readout{d.contains("all_logits") ? d["all_logits"].cast<bool>() : true,
                     d.contains("read_logits") ? d["read_logits"].cast<bool>() : true, (int) top_k};
    p.whole   = d.contains("whole") && d["whole"].cast<bool>();
    p.capture = d.contains("capture_layers") ? d["capture_layers"].cast<std::vector<int>>() : std::vector<int>{};
    return p;
}

py::list eval_batch(session_batch & b, const py::list & parts_in) {
    std::vector<part_arrays> held;
    for (size_t i = 0; i < parts_in.size(); ++i) {
        held.push_back(read_part(i, parts_in[i].cast<py::dict>()));
    }
    std::vector<session_batch::part> parts;
    for (const part_arrays & p : held) {
        parts.push_back({p.s, p.tokens.data(), (int) p.tokens.size(), p.layout.layout(p.whole), p.what, p.capture});
    }
    {
        py::gil_scoped_release nogil;
        b.eval(parts);
    }
    py::list out;
    for (const part_arrays & p : held) {
        out.append(eval_result(*p.s, (int) p.tokens.size(), p.capture, p.what.top_k, p.what.logits));
    }
    return out;
}
}  // namespace

void register_session_batch(py::module_ & m) {
    py::class_<session_batch>(m, "SessionBatch")
        .def(py::init([](const py_model & m) { return std::make_unique<session_batch>(m.model); }), py::arg("model"),
             py::keep_alive<1, 2>())
        .def("eval", &eval_batch, py::arg("parts"),
             "Evaluate several Sessions' batches in one graph. parts: one dict per session, with Session.eval's "
             "arguments ('session', 'tokens', and optionally 'positions', 'mask', 'parents', 'all_logits', "
             "'read_logits', 'top_k', 'whole', 'capture_layers'); returns Session.eval's result for each. Each "
             "session then commits as after its own eval.")
        .def_property_readonly("compute_memory", [](const session_batch & b) { return as_pair(b.compute_memory()); });
    py::class_<eval_batcher>(m, "EvalBatcher",
                             "Continuous batching for the Sessions of one Model generating in threads of their own: "
                             "pass it to each Session.generate, and every step's target evaluations run as one.")
        .def(py::init([](const py_model & m) { return std::make_unique<eval_batcher>(m.model); }), py::arg("model"),
             py::keep_alive<1, 2>())
        .def_property_readonly("compute_memory", [](const eval_batcher & b) { return as_pair(b.compute_memory()); },
                               "(CPU bytes, GPU bytes) of its batched graphs' compute buffers, as allocated so far.")
        .def_property_readonly("row_tile", &eval_batcher::row_tile,
                               "The tile a speculative step's rows come in: 4 where a dense target computes on the "
                               "CPU (ggml's quantized matmuls take rows four at a time), else 1 (a GPU, a MoE "
                               "target).")
        .def("step_times", &eval_batcher::step_times_measured, py::call_guard<py::gil_scoped_release>(),
             "What its steps measured, {parts: {rows: ms}} (what pydflash/cost_cache.py keeps), once no step runs.")
        .def("restore_step_times", &eval_batcher::restore_step_times, py::arg("table"),
             py::call_guard<py::gil_scoped_release>(),
             "Step times measured earlier, as step_times() gave them: the batch plans from its first step (ValueError "
             "for a shape no step has, or a time that is not a positive number: nothing restored).")
        .def_property_readonly("stats", [](const eval_batcher & b) {
                const eval_batcher::counts c = b.stats();
                py::dict d;
                d["batches"]       = c.batches;
                d["batched_parts"] = c.batched_parts;
                d["alone"]         = c.alone;
                d["batched_ms"]    = c.batched_ms;
                d["max_rows"]      = c.max_rows;
                d["planned"]       = c.planned;
                d["draft_batches"]  = c.draft_batches;
                d["batched_drafts"] = c.batched_drafts;
                d["head_batches"]   = c.head_batches;
                d["batched_head_steps"] = c.batched_head_steps;
                d["cooldowns"]      = c.cooldowns;
                d["step_shapes"]    = c.step_shapes;
                d["one_by_one"]     = c.one_by_one;
                return d;
            },
            "{'batches': evaluations of several generations' parts together, 'batched_parts': the parts they held, "
            "'alone': parts evaluated alone, 'batched_ms': the batched evaluations' time, 'max_rows': the most rows "
            "one held, 'planned': steps whose auto generations' verifies the batch planned together, 'draft_batches': drafter "
            "graphs over several generations' drafts, 'batched_drafts': the drafts they held, 'head_batches': graphs of the "
            "target's MTP head over several generations' steps, 'batched_head_steps': the steps they held, "
            "'cooldowns': the batch's "
            "cool-downs of its auto generations' drafting, 'step_shapes': the step shapes whose times it holds "
            "(step_times()), 'one_by_one': steps of several plain parts run part by part, where measured "
            "cheaper}.");
}

}  // namespace pdf::bindings
