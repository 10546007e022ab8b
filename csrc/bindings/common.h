// What the binding files share: the Python-side holders of the core's objects and the converters that check
// Python arguments as they cross into C++ (a typed exception naming the argument and the range expected).
#pragma once

#include "core/error.h"
#include "core/weights.h"
#include "decode/engine_params.h"
#include "decode/proposer_choice.h"
#include "decode/sampler.h"
#include "models/dflash.h"
#include "models/model.h"
#include "state/draft_session.h"
#include "state/mtp_session.h"
#include "state/session.h"

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pdf::bindings {

namespace py = pybind11;

// the largest context a session accepts: positions are int32, and windows are padded beyond them
inline constexpr int64_t MAX_CTX = 1 << 30;
// the most per-token (or per-node) recurrent states a session keeps for rollback
inline constexpr int64_t MAX_ROLLBACK = 1 << 16;

// Model: the read-only weights, shareable between sessions
struct py_model {
    std::shared_ptr<const target_model> model;
    std::shared_ptr<target_model>       planned;  // the same model while it is a memory plan's (load_weights)
};

// DFlash draft weights, loaded once and shared by the draft sessions of every target session over its target
struct py_draft_model {
    std::shared_ptr<const dflash_draft> model;
    std::shared_ptr<dflash_draft>       planned;  // the same drafter while it is a memory plan's (load_weights)
};

// A drafter for one target session, with what the decode loop learns about it on this machine (costs, how far
// its probabilities can be trusted), kept across generate calls, and how it speculates (set once, at creation)
struct py_draft {
    std::unique_ptr<draft_session>     session;
    std::unique_ptr<speculation_state> state;
    spec_params                        spec;

    speculation with(const spec_params & p) const { return {*session, *state, p}; }
};

// n-gram lookup for one target session, with what the decode loop learns about it (costs, acceptance by match
// length) kept across generate calls, and how it speculates
struct py_ngram {
    std::unique_ptr<ngram_index>       index;
    std::unique_ptr<speculation_state> state;
    std::unique_ptr<acceptance_model>  against_drafter;  // (merged with a drafter: decode/union_proposer.h)
    spec_params                        spec;
    int                                block = 0;

    ngram_speculation with(const spec_params & p) const { return {*index, *state, p, block, *against_drafter}; }
};

// The target's own MTP head for one target session (its cache and the trunk-state ring), with what the decode loop
// learns about it kept across generate calls, and how it speculates
struct py_mtp {
    std::unique_ptr<mtp_session>       head;
    std::unique_ptr<speculation_state> state;
    spec_params                        spec;

    mtp_speculation with(const spec_params & p) const { return {*head, *state, p}; }
};

// what the decode loop measured and learnt about a proposer (auto mode): ms per verify width, draft ms, rates, the
// acceptance of its first choice by depth (1 .. block - 1) at probability 0.5-0.6, and what cost_cache.py keeps
py::dict costs_dict(const speculation_state & st, int block);
// the acceptance model's (tried, accepted) counts per cell, as costs_dict gives them (decode/acceptance_model.h)
using acceptance_counts = std::pair<std::vector<double>, std::vector<double>>;
// verify times measured earlier (ms by width), auto's cool-down length then and, if given, what the target
// accepted then (std::invalid_argument for counts that model cannot hold, before anything changes)
void     restore_costs(speculation_state & st, const std::map<int, double> & chain, const std::map<int, double> & tree,
                       int64_t cool_len, const std::optional<acceptance_counts> & acceptance);

// costs() and restore_costs() on a proposer's binding class T: state_of(const T &) its speculation_state &,
// block_of(const T &) its block size (DraftSession documents both in full; MtpDrafter and NgramDrafter refer to it)
template <class T, class StateOf, class BlockOf>
void def_cost_model(py::class_<T> & cls, StateOf state_of, BlockOf block_of, const char * costs_doc,
                    const char * restore_doc) {
    cls.def("costs", [=](const T & o) { return costs_dict(state_of(o), block_of(o)); }, costs_doc)
        .def("restore_costs",
             [=](T & o, const std::map<int, double> & chain, const std::map<int, double> & tree, int64_t cool_len,
                 const std::optional<acceptance_counts> & acceptance) {
                 restore_costs(state_of(o), chain, tree, cool_len, acceptance);
             },
             py::arg("verify_ms"), py::arg("tree_verify_ms"), py::arg("cool_len") = 0,
             py::arg("acceptance") = py::none(), restore_doc);
}

// Integer arguments arrive as int64 (pybind refuses floats and None with a TypeError) and are range-checked
// here, naming the parameter, before they are narrowed.
int64_t checked(const char * name, int64_t v, int64_t lo, int64_t hi);
// tree_budget as the bindings take it (0: the default by spec_mode), in the engine's one bound, MAX_TREE_BUDGET
// (decode/engine_params.h). pydflash.Model and plan check the user's value first (1 .. MAX_TREE_BUDGET), so
// this refuses only what a direct caller of _core passes.
int     tree_budget_arg(int64_t v);
// a 1-D array of token ids / positions: integers (a float array is refused, not truncated) that fit int32
std::vector<int32_t> int32_array(const char * name, const py::handle & o);
ggml_type   parse_kv_type(const std::string & name);
spec_mode   parse_spec_mode(const std::string & name);
tree_seed   parse_tree_seed(const std::string & name);
std::string type_name(const py::handle & o);

// (CPU bytes, GPU bytes)
inline std::pair<size_t, size_t> as_pair(const device_bytes & n) {
    return {n.cpu, n.gpu};
}

// sampling parameters from a dict with llama-cpp-python's names (None or {}: greedy); unknown keys are an error
sampling_params parse_sampling(const py::object & o, int64_t n_vocab);
// {"token_logprobs": [...], "top_logprobs": [[(id, logprob)] ...]}
py::dict logprobs_dict(const std::vector<token_logprobs> & lps);

// one per concept; module.cpp calls them in this order (a later one may add methods to an earlier one's class)
// the layout of an eval's batch: positions, a visibility mask or a tree's parents (each optional)
struct batch_arrays {
    std::vector<int32_t> positions, parents;
    std::vector<uint8_t> mask;

    batch_arrays(int n, const py::object & positions_in, const py::object & mask_in, const py::object & parents_in) {
        auto as_rows = [n](const py::object & o, const char * what) {
            std::vector<int32_t> a = int32_array(what, o);
            if ((int) a.size() != n) {
                throw std::invalid_argument(format("eval: %s must have one entry per token", what));
            }
            return a;
        };
        if (!positions_in.is_none()) {
            positions = as_rows(positions_in, "positions");
        }
        if (!parents_in.is_none()) {
            parents = as_rows(parents_in, "parents");
        }
        if (!mask_in.is_none()) {
            auto a = mask_in.cast<py::array_t<uint8_t, py::array::c_style | py::array::forcecast>>();
            if (a.ndim() != 2 || a.shape(0) != n || a.shape(1) != n) {
                throw std::invalid_argument("eval: mask must have shape (n_tokens, n_tokens)");
            }
            mask.assign(a.data(), a.data() + (size_t) n * n);
        }
    }

    batch_layout layout(bool whole) const {
        batch_layout l;
        l.positions = positions.empty() ? nullptr : positions.data();
        l.mask      = mask.empty() ? nullptr : mask.data();
        l.parents   = parents.empty() ? nullptr : parents.data();
        l.whole     = whole;
        return l;
    }
};

// what an eval read back: (logits [n_out, n_vocab], [hidden [n, n_embd] per capture layer]) and, with top_k > 0,
// (top ids, log-probabilities [n_out, top_k])
py::tuple eval_result(const session & s, int n, const std::vector<int> & capture_layers, int64_t top_k,
                      bool read_logits);

void register_errors(py::module_ & m);
void register_log(py::module_ & m);
void register_gguf(py::module_ & m);
void register_quantize(py::module_ & m);
void register_rpc(py::module_ & m);
void register_model(py::module_ & m);
void register_engine_params(py::module_ & m);
void register_draft_session(py::module_ & m);
void register_ngram(py::module_ & m);
void register_mtp(py::module_ & m);
void register_session(py::module_ & m);
void register_session_batch(py::module_ & m);
void register_generate(py::module_ & m);
void register_test_hooks(py::module_ & m);

}  // namespace pdf::bindings
