// Session.generate: the decode loop (decode/driver.h) with the proposer decode/proposer_choice.h picks, its
// sampling parameters from llama-cpp-python's names, and its result and timings as Python dicts
#include "bindings/common.h"

#include <algorithm>
#include <cstring>
#include <optional>

namespace pdf::bindings {

// A sampling dict's values converted to the fields' types (a TypeError for a value of another type; integers
// narrowed to int32). What the values may be is checked in one place, sampling_params::validate, which
// generate and the sampler run before any work; pydflash.Model checks its own arguments before they get here.
static float as_number(const char * name, const py::handle & v) {
    if (!py::isinstance<py::float_>(v) && !py::isinstance<py::int_>(v)) {
        throw py::type_error(format("%s must be a number", name));
    }
    return (float) v.cast<double>();
}

static int as_int(const char * name, const py::handle & v, int64_t lo = INT32_MIN) {
    if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v)) {
        throw py::type_error(format("%s must be an int", name));
    }
    return (int) checked(name, v.cast<int64_t>(), lo, INT32_MAX);
}

struct float_field {
    const char * name;
    float sampling_params::*field;
};

struct int_field {
    const char * name;
    int sampling_params::*field;
};

static constexpr float_field FLOAT_FIELDS[] = {
    {"temperature", &sampling_params::temperature},           {"top_p", &sampling_params::top_p},
    {"min_p", &sampling_params::min_p},                       {"typical_p", &sampling_params::typical_p},
    {"repeat_penalty", &sampling_params::repeat_penalty},     {"presence_penalty", &sampling_params::presence_penalty},
    {"frequency_penalty", &sampling_params::frequency_penalty},
};
static constexpr int_field INT_FIELDS[] = {{"top_k", &sampling_params::top_k},
                                           {"repeat_last_n", &sampling_params::repeat_last_n}};

// a Python object with allowed() -> the next position's mask (a buffer of uint32 words, a bit per token id),
// accept(token) and (optionally) valid_prefix(tokens) -> int as the sampler's grammar, each call made with the GIL
// taken back; a Python exception propagates out of the loop
class py_constraint : public token_constraint {
  public:
    py_constraint(py::object obj, int64_t n_vocab) :
        obj_(std::move(obj)),
        tells_drafts_(py::hasattr(obj_, "valid_prefix")),
        words_((size_t) (n_vocab + 31) / 32) {}
    ~py_constraint() override {
        py::gil_scoped_acquire gil;
        obj_ = py::object();
    }

    const uint32_t * allowed() override {
        py::gil_scoped_acquire gil;
        const py::buffer_info b = py::buffer(obj_.attr("allowed")()).request();
        if (b.size * b.itemsize < (py::ssize_t) (words_.size() * sizeof(uint32_t))) {
            throw std::invalid_argument(format("constraint.allowed(): %zd bytes, expected %zu (a bit per token)",
                                               (size_t) (b.size * b.itemsize), words_.size() * sizeof(uint32_t)));
        }
        std::memcpy(words_.data(), b.ptr, words_.size() * sizeof(uint32_t));
        return words_.data();
    }
    void accept(int32_t token) override {
        py::gil_scoped_acquire gil;
        obj_.attr("accept")(token);
    }
    int valid_prefix(const int32_t * tokens, int n) override {
        if (!tells_drafts_) {
            return n;  // (an object that cannot tell: every draft verified)
        }
        py::gil_scoped_acquire gil;
        py::list l;
        for (int i = 0; i < n; ++i) {
            l.append(tokens[i]);
        }
        return (int) std::clamp<int64_t>(obj_.attr("valid_prefix")(l).cast<int64_t>(), 0, n);
    }

  private:
    py::object            obj_;
    bool                  tells_drafts_;  // it has valid_prefix()
    std::vector<uint32_t> words_;
};

// the fields that are not a plain number: seed (any int, taken modulo 2^64), logprobs (None: off),
// post_sampling_probs (a bool), logit_bias, constraint (py_constraint's object; needs n_vocab, set by the caller)
static bool set_special_field(sampling_params & p, const std::string & key, const py::handle & v, int64_t n_vocab) {
    if (key == "seed") {
        if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v)) {
            throw py::type_error("seed must be an int");
        }
        p.seed = py::reinterpret_borrow<py::int_>(v).attr("__and__")(py::int_(UINT64_MAX)).cast<uint64_t>();
    } else if (key == "logprobs") {
        p.n_logprobs = v.is_none() ? -1 : as_int("logprobs", v, 0);
    } else if (key == "post_sampling_probs") {
        p.post_sampling_probs = v.cast<bool>();
    } else if (key == "constraint") {
        p.constraint = v.is_none() ? nullptr : std::make_shared<py_constraint>(py::reinterpret_borrow<py::object>(v),
                                                                               n_vocab);
    } else if (key == "logit_bias") {
        for (const auto & [id, bias] : v.cast<py::dict>()) {
            p.logit_bias.emplace_back((int32_t) as_int("logit_bias key", id, 0), as_number("logit_bias value", bias));
        }
    } else {
        return false;
    }
    return true;
}

sampling_params parse_sampling(const py::object & o, int64_t n_vocab) {
    sampling_params p;
    if (o.is_none()) {
        return p;
    }
    for (const auto & [key_h, v] : o.cast<py::dict>()) {
        const std::string key   = key_h.cast<std::string>();
        bool              found = set_special_field(p, key, v, n_vocab);
        for (const float_field & f : FLOAT_FIELDS) {
            if (!found && key == f.name) {
                p.*f.field = as_number(f.name, v);
                found      = true;
            }
        }
        for (const int_field & f : INT_FIELDS) {
            if (!found && key == f.name) {
                p.*f.field = as_int(f.name, v);
                found      = true;
            }
        }
        if (!found) {
            throw std::invalid_argument("unknown sampling parameter '" + key + "'");
        }
    }
    return p;
}

py::dict logprobs_dict(const std::vector<token_logprobs> & lps) {
    py::list token_lp, top;
    for (const token_logprobs & lp : lps) {
        token_lp.append(lp.logprob);
        py::list alternatives;
        for (const auto & [id, v] : lp.top) {
            alternatives.append(py::make_tuple(id, v));
        }
        top.append(alternatives);
    }
    py::dict d;
    d["token_logprobs"] = token_lp;
    d["top_logprobs"]   = top;
    return d;
}

// proposer: what drafted ("dflash", "ngram", "mtp", or those merged: "dflash+ngram", "dflash+ngram+mtp", ...;
// nullptr: plain decoding, no speculative counts)
static py::dict timings_dict(const generate_timings & t, const char * proposer, const auto_stats * a) {
    const bool speculative = proposer != nullptr;
    py::dict   d;
    d["prompt_n"]       = t.prompt_n;
    d["cached_n"]       = t.cached_n;
    d["prompt_ms"]      = t.prompt_ms;
    d["predicted_n"]    = t.predicted_n;
    d["predicted_ms"]   = t.predicted_ms;
    d["n_target_evals"] = t.n_target_evals;
    d["sample_ms"]      = t.sample_ms;
    if (speculative) {
        d["proposer"]         = proposer;
        d["draft_n"]          = t.draft_n;
        d["draft_n_accepted"] = t.draft_n_accepted;
        d["n_rounds"]         = t.n_rounds;
        d["verify_n"]         = t.verify_n;
        d["draft_ms"]         = t.draft_ms;
        d["verify_ms"]        = t.verify_ms;
        d["accepted_at"]      = t.accepted_at;
        d["proposed_at"]      = t.proposed_at;
        if (a) {
            d["auto_skipped"] = a->n_skipped;
            d["auto_plain"]   = a->n_plain;
            d["auto_chain"]   = a->n_chain;
            d["auto_tree"]    = a->n_tree;
        }
        if (a && std::string(proposer).find('+') != std::string::npos) {
            py::dict by;
            for (int k : {0, 1, 2}) {  // (auto_stats' order)
                const char * name = k == 0 ? "dflash" : k == 1 ? "ngram" : "mtp";
                if (std::string(proposer).find(name) == std::string::npos) {
                    continue;
                }
                py::dict one;
                one["ran"]      = a->ran_by[k];
                one["rounds"]   = a->rounds_by[k];
                one["drafted"]  = a->drafted_by[k];
                one["accepted"] = a->accepted_by[k];
                by[name]        = one;
            }
            d["by_proposer"] = by;
        }
    }
    return d;
}

// a Python callback(tokens[, logprobs]) -> bool as the loop's token_callback, run with the GIL taken back; a
// Python exception propagates out of the loop
static token_callback python_callback(const py::object & callback) {
    if (callback.is_none()) {
        return {};
    }
    return [&callback](const int32_t * toks, const token_logprobs * lps, int n) {
        py::gil_scoped_acquire gil;
        py::list l;
        for (int i = 0; i < n; ++i) {
            l.append(toks[i]);
        }
        if (lps) {
            return callback(l, logprobs_dict({lps, lps + n})).cast<bool>();
        }
        return callback(l).cast<bool>();
    };
}

// a proposer's own way of speculating, with what this call overrides
static spec_params spec_for(const spec_params & own, const std::optional<std::string> & mode,
                            std::optional<int64_t> tree_budget, const std::optional<std::string> & seed) {
    spec_params sp = own;
    if (mode) {
        sp.mode = parse_spec_mode(*mode);
    }
    if (tree_budget) {
        sp.tree_budget = tree_budget_arg(*tree_budget);
    }
    if (seed) {
        sp.seed = parse_tree_seed(*seed);
    }
    return sp;
}

static py::dict generate(session & s, py::object prompt_in, int64_t max_tokens, py::object stop_tokens_in,
                         py::object callback, py_draft * draft, py_ngram * ngram, py_mtp * mtp,
                         std::optional<std::string> mode,
                         std::optional<int64_t> tree_budget, std::optional<std::string> seed, py::object sampling,
                         eval_batcher * batcher) {
    const std::vector<int32_t> prompt = int32_array("prompt", prompt_in);
    generate_params            p;
    p.max_tokens  = (int) checked("max_tokens", max_tokens, 0, INT32_MAX);
    p.stop_tokens = int32_array("stop_tokens", stop_tokens_in);
    p.sampling    = parse_sampling(sampling, s.model().info().n_vocab);  // (validated by generate before any work)
    std::optional<speculation>       spec;
    std::optional<ngram_speculation> lookup;
    if (draft) {
        spec.emplace(draft->with(spec_for(draft->spec, mode, tree_budget, seed)));
    }
    if (ngram) {
        lookup.emplace(ngram->with(spec_for(ngram->spec, mode, tree_budget, seed)));
    }
    std::optional<mtp_speculation> head;
    if (mtp) {
        head.emplace(mtp->with(spec_for(mtp->spec, mode, tree_budget, seed)));
    }
    const token_callback cb = python_callback(callback);
    generate_result      r;
    auto_stats           stats;
    {
        py::gil_scoped_release nogil;
        r = generate_with(s, {spec ? &*spec : nullptr, lookup ? &*lookup : nullptr, head ? &*head : nullptr}, prompt,
                          p, cb, stats, batcher);
    }
    py::dict d;
    d["tokens"]        = r.tokens;
    d["finish_reason"] = r.finish_reason;
    d["stop_token"]    = r.stop_token >= 0 ? py::object(py::int_(r.stop_token)) : py::none();
    if (p.sampling.n_logprobs >= 0) {
        d["logprobs"] = logprobs_dict(r.logprobs);
        if (r.stop_token >= 0) {
            d["stop_logprobs"] = logprobs_dict({r.stop_logprobs});
        }
    }
    const spec_params * used      = spec ? &spec->params : lookup ? &lookup->params : head ? &head->params : nullptr;
    const bool          automatic = used && used->mode == spec_mode::automatic;
    std::string         names;  // what drafted: "dflash", "ngram", "mtp", or those merged ("dflash+ngram+mtp")
    for (const auto & [given, name] : {std::pair<bool, const char *>{spec.has_value(), "dflash"},
                                       {lookup.has_value(), "ngram"}, {head.has_value(), "mtp"}}) {
        names += given ? (names.empty() ? "" : "+") + std::string(name) : "";
    }
    d["timings"] = timings_dict(r.timings, names.empty() ? nullptr : names.c_str(), automatic ? &stats : nullptr);
    return d;
}

void register_generate(py::module_ & m) {
    auto cls = py::reinterpret_borrow<py::class_<session>>(m.attr("Session"));
    cls.def("generate", &generate, py::arg("prompt"), py::arg("max_tokens") = 128, py::arg("stop_tokens") = py::list(),
            py::arg("callback") = py::none(), py::arg("draft") = nullptr, py::arg("ngram") = nullptr,
            py::arg("mtp") = nullptr, py::arg("spec_mode") = py::none(),
            py::arg("tree_budget") = py::none(), py::arg("tree_seed") = py::none(), py::arg("sampling") = py::none(),
            py::arg("batcher") = nullptr,
            "Generation, greedy or sampled (sampling: a dict of llama-cpp-python's sampling parameters and seed), "
            "speculative with a DraftSession, an NgramDrafter, an MtpDrafter, or two or three of them "
            "together (spec_mode 'auto' only: one tree of their "
            "candidates, decode/union_proposer.h), each as it was created to speculate (spec_mode 'chain', 'tree' or "
            "'auto', tree_budget and tree_seed given here override it for this call); callback(list[int]) -> bool is "
            "called (with the GIL) per batch of committed tokens. The result's 'stop_token': the stop token that "
            "ended it (not among 'tokens'), else None. With sampling['logprobs'] = n the result has 'logprobs': "
            "token_logprobs and top_logprobs ([(id, logprob)] * n) per token (and 'stop_logprobs', the same for the "
            "stop token), and the callback gets the batch's as a second argument. batcher: the Model's EvalBatcher, "
            "when other Sessions over it may generate at the same time: each target evaluation then joins theirs "
            "(one batched evaluation per step).");
}

}  // namespace pdf::bindings
