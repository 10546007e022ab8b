// NgramDrafter: n-gram (prompt lookup) drafting for one target session (decode/ngram_proposer.h), what the decode
// loop learns about it kept across generate calls; and the lookup itself, for the tests
#include "bindings/common.h"

namespace pdf::bindings {

static ngram_params lookup_params(int64_t n_min, int64_t n_max, int64_t max_candidates) {
    ngram_params p;
    p.n_min          = (int) checked("n_min", n_min, 1, 16);
    p.n_max          = (int) checked("n_max", n_max, 1, 16);
    p.max_candidates = (int) checked("max_candidates", max_candidates, 1, 64);
    return p;
}

static py_ngram make_ngram(int64_t block_size, const std::string & mode, int64_t tree_budget, int64_t n_min,
                           int64_t n_max, int64_t max_candidates) {
    py_ngram g;
    g.index            = std::make_unique<ngram_index>(lookup_params(n_min, n_max, max_candidates));
    g.block            = (int) checked("block_size", block_size, 2, dflash_draft::MAX_BLOCK_SIZE);
    g.spec.mode        = parse_spec_mode(mode);
    g.spec.tree_budget = tree_budget_arg(tree_budget);
    g.state            = std::make_unique<speculation_state>(MAX_TREE_BUDGET + 1);
    g.against_drafter  = std::make_unique<acceptance_model>();
    return g;
}

static py::list candidates(const std::vector<int32_t> & tokens, int32_t anchor, int64_t max_depth, int64_t n_min,
                           int64_t n_max, int64_t max_candidates) {
    ngram_index index(lookup_params(n_min, n_max, max_candidates));
    index.sync(tokens);
    py::list out;
    for (const ngram_candidate & c : index.candidates(anchor, (int) checked("max_depth", max_depth, 0, 1 << 20))) {
        out.append(py::make_tuple(c.tokens, c.match_len));
    }
    return out;
}

static int32_t most_frequent(const std::vector<int32_t> & tokens) {
    ngram_index index(ngram_params{});
    index.sync(tokens);
    return index.most_frequent();
}

void register_ngram(py::module_ & m) {
    py::class_<py_ngram> cls(m, "NgramDrafter");
    def_cost_model(
        cls, [](const py_ngram & g) -> speculation_state & { return *g.state; },
        [](const py_ngram & g) { return g.block; },
        "The speculation cost model, as DraftSession.costs() (a node's probability: its match length's prior, "
        "ngram_prior).",
        "Verify times, auto's cool-down length and the acceptance counts measured earlier, as "
        "DraftSession.restore_costs().");
    cls.def(py::init(&make_ngram), py::arg("block_size") = NGRAM_DEFAULT_BLOCK, py::arg("spec_mode") = "auto",
             py::arg("tree_budget") = 0, py::arg("n_min") = ngram_params{}.n_min,
             py::arg("n_max") = ngram_params{}.n_max, py::arg("max_candidates") = ngram_params{}.max_candidates,
             "Drafts what followed earlier occurrences of the context's last n tokens (n_max down to n_min), at "
             "most block_size - 1 deep: the best continuation (spec_mode 'chain'), max_candidates of them merged "
             "into a tree of at most tree_budget nodes ('tree'), or that tree cut where auto's cost model says "
             "('auto'). Give it to Session.generate(ngram=...); one per session.")
        .def_property_readonly("block_size", [](const py_ngram & g) { return g.block; })
        .def_property_readonly("spec_mode", [](const py_ngram & g) {
            return g.spec.mode == spec_mode::chain ? "chain" : g.spec.mode == spec_mode::tree ? "tree" : "auto";
        })
        .def_property_readonly("tree_budget", [](const py_ngram & g) { return g.spec.tree_budget; });
    m.def("ngram_candidates", &candidates, py::arg("tokens"), py::arg("anchor"), py::arg("max_depth"),
          py::arg("n_min") = ngram_params{}.n_min, py::arg("n_max") = ngram_params{}.n_max,
          py::arg("max_candidates") = ngram_params{}.max_candidates,
          "The continuations n-gram lookup proposes after tokens + [anchor]: [(tokens, n matched)], best first.");
    m.def("ngram_guess", &most_frequent, py::arg("tokens"),
          "What auto's n-gram rounds guess where nothing matches: the most frequent of tokens (the earliest to "
          "reach that count); -1 for none.");
}

}  // namespace pdf::bindings
