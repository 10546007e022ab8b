#include "bindings/common.h"

#include <cstdint>

namespace pdf::bindings {

int64_t checked(const char * name, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi) {
        throw std::invalid_argument(format("%s = %lld, expected a value in [%lld, %lld]", name, (long long) v,
                                           (long long) lo, (long long) hi));
    }
    return v;
}

int tree_budget_arg(int64_t v) {
    return (int) checked("tree_budget", v, 0, MAX_TREE_BUDGET);
}

std::vector<int32_t> int32_array(const char * name, const py::handle & o) {
    py::array a = py::array::ensure(o);
    if (!a || a.ndim() != 1 || (a.size() > 0 && a.dtype().kind() != 'i' && a.dtype().kind() != 'u')) {
        throw py::type_error(format("%s must be a 1-D sequence of integers", name));
    }
    if (a.dtype().kind() == 'u') {  // (uint64 values above INT64_MAX would wrap to negatives in the int64 cast)
        py::array_t<uint64_t, py::array::c_style | py::array::forcecast> u(a);
        for (py::ssize_t i = 0; i < u.size(); ++i) {
            if (u.data()[i] > (uint64_t) INT32_MAX) {
                throw std::invalid_argument(format("%s = %llu, expected a value in [%d, %d]", name,
                                                   (unsigned long long) u.data()[i], INT32_MIN, INT32_MAX));
            }
        }
    }
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> wide(a);
    std::vector<int32_t> out(wide.size());
    for (py::ssize_t i = 0; i < wide.size(); ++i) {
        out[i] = (int32_t) checked(name, wide.data()[i], INT32_MIN, INT32_MAX);
    }
    return out;
}

ggml_type parse_kv_type(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name((ggml_type) t);
        if (tn && name == tn) {
            return (ggml_type) t;
        }
    }
    throw std::invalid_argument("unknown kv_type '" + name + "' (expected f32, f16, bf16, q8_0, q4_0, ...)");
}

spec_mode parse_spec_mode(const std::string & name) {
    if (name == "auto") {
        return spec_mode::automatic;
    }
    if (name == "tree") {
        return spec_mode::tree;
    }
    if (name == "chain") {
        return spec_mode::chain;
    }
    throw std::invalid_argument("spec_mode = '" + name + "' is not one of 'auto', 'tree', 'chain'");
}

tree_seed parse_tree_seed(const std::string & name) {
    if (name == "chain") {
        return tree_seed::chain;
    }
    if (name == "best_first") {
        return tree_seed::best_first;
    }
    throw std::invalid_argument("tree_seed = '" + name + "' is not one of 'chain', 'best_first'");
}

std::string type_name(const py::handle & o) {
    return py::str(py::type::of(o).attr("__name__")).cast<std::string>();
}

py::dict costs_dict(const speculation_state & st, int block) {
    const cost_model & c = st.costs;
    py::dict           out, chain, tree;
    for (int w : c.grid()) {
        chain[py::int_(w)] = c.verify_ms(w, false);
        tree[py::int_(w)]  = c.verify_ms(w, true);
    }
    // P(accepted | parent accepted) of the first choice by depth, for probabilities of 0.5-0.6 (the bin at 0.55)
    std::vector<double> p_half;
    for (int depth = 1; depth < block; ++depth) {
        p_half.push_back(st.acceptance.p_accept(depth, 0, 0.55));
    }
    out["calibrated"]       = c.calibrated();
    out["verify_ms"]        = chain;
    out["tree_verify_ms"]   = tree;
    out["draft_ms"]         = c.draft_ms();
    out["plain_rate"]       = c.plain_rate();
    out["spec_rate"]        = c.spec_rate();
    out["p_accept_at_half"] = p_half;
    py::dict measured, measured_tree;  // (cost_cache.py keeps these across processes)
    for (const cost_model::measurement & x : c.measured()) {
        (x.tree ? measured_tree : measured)[py::int_(x.width)] = x.ms;
    }
    out["measured"] = py::make_tuple(measured, measured_tree);
    out["cool_len"] = st.cool_len;
    const auto [tried, accepted] = st.acceptance.counts();  // (cost_cache.py keeps them too)
    out["acceptance"]            = py::make_tuple(tried, accepted);
    return out;
}

void restore_costs(speculation_state & st, const std::map<int, double> & chain, const std::map<int, double> & tree,
                   int64_t cool_len, const std::optional<acceptance_counts> & acceptance) {
    if (acceptance) {
        st.acceptance.restore(acceptance->first, acceptance->second);  // (checked before anything is changed)
    }
    std::vector<cost_model::measurement> table;
    for (const auto & [w, ms] : chain) {
        table.push_back({w, false, ms});
    }
    for (const auto & [w, ms] : tree) {
        table.push_back({w, true, ms});
    }
    st.costs.restore(table);
    // auto resumes where the last process left off: when speculation had stopped paying, it decodes plainly for
    // the cool-down it had reached before it probes again (decode/proposer.cpp)
    st.cool_len = (int) checked("cool_len", cool_len, 0, INT32_MAX);
    st.cooldown = st.cool_len;
}

}  // namespace pdf::bindings
