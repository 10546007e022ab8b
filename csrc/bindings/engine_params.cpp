// resolve_engine_params (decode/engine_params.h) for pydflash.Model and pydflash.plan: the options they checked
// in, every session and drafter argument out
#include "bindings/common.h"

namespace pdf::bindings {

static const char * spec_mode_name(spec_mode mode) {
    return mode == spec_mode::chain ? "chain" : mode == spec_mode::tree ? "tree" : "auto";
}

// {"session": Session's keyword arguments, "draft": DraftSession's (None without a drafter), ...}
static py::dict as_dict(const engine_params & p, const std::string & kv_type) {
    py::dict session;
    session["n_ctx"]      = p.n_ctx;
    session["type_k"]     = kv_type;
    session["type_v"]     = kv_type;
    session["n_ubatch"]   = p.n_ubatch;
    session["n_rollback"] = p.n_rollback;
    py::object draft      = py::none();
    py::object ngram      = py::none();
    py::object mtp        = py::none();
    if (p.mtp) {
        py::dict g;
        g["block_size"]  = p.mtp_block > 0 ? p.mtp_block : p.block;
        g["spec_mode"]   = spec_mode_name(p.mode);
        g["max_verify"]  = p.max_verify;
        g["tree_budget"] = p.tree_budget;
        g["top_k"]       = p.top_k;
        mtp              = g;
    }
    if (p.ngram) {
        py::dict g;
        g["block_size"]  = p.block;
        g["spec_mode"]   = spec_mode_name(p.mode);
        g["tree_budget"] = p.tree_budget;
        ngram            = g;
    }
    if (p.drafter) {
        py::dict d;
        d["n_ctx"]         = p.n_ctx;
        d["block_size"]    = p.block_request;
        d["window"]        = p.draft_window;
        d["ring_capacity"] = p.ring_capacity;
        d["top_k"]         = p.top_k;
        d["with_logprobs"] = p.with_logprobs;
        d["max_verify"]    = p.max_verify;
        d["spec_mode"]     = spec_mode_name(p.mode);
        d["tree_budget"]   = p.tree_budget;
        draft              = d;
    }
    py::dict out;
    out["session"]           = session;
    out["draft"]             = draft;
    out["ngram"]             = ngram;
    out["mtp"]               = mtp;
    out["tree_budget"]       = p.speculative ? py::object(py::int_(p.tree_budget)) : py::none();
    out["block"]             = p.speculative ? py::object(py::int_(p.block)) : py::none();
    out["ubatch_candidates"] = p.ubatch_candidates;
    return out;
}

static py::dict resolve(const py_model & target, const py::object & draft, int64_t n_ctx, const std::string & kv_type,
                        int64_t n_ubatch, int64_t block_size, int64_t tree_budget, int64_t draft_window,
                        const std::string & mode, bool ngram, const std::string & mtp) {
    engine_options o;
    o.n_ctx        = (int) checked("n_ctx", n_ctx, 1, MAX_CTX);
    o.n_ubatch     = (int) checked("n_ubatch", n_ubatch, 0, MAX_CTX);
    o.block_size   = (int) checked("block_size", block_size, 0, dflash_draft::MAX_BLOCK_SIZE);
    o.tree_budget  = tree_budget_arg(tree_budget);
    o.draft_window = (int) checked("draft_window", draft_window, 1, INT32_MAX);
    o.mode         = parse_spec_mode(mode);
    o.ngram        = ngram;
    if (mtp != "off" && mtp != "on" && mtp != "if_present") {
        throw std::invalid_argument(format("mtp = '%s', expected 'off', 'on' or 'if_present'", mtp.c_str()));
    }
    o.mtp = mtp == "on" ? mtp_use::on : mtp == "if_present" ? mtp_use::if_present : mtp_use::off;
    parse_kv_type(kv_type);
    const dflash_draft * d = draft.is_none() ? nullptr : draft.cast<const py_draft_model &>().model.get();
    return as_dict(resolve_engine_params(*target.model, d, o), kv_type);
}

void register_engine_params(py::module_ & m) {
    // the bounds pydflash.Model checks its options against
    m.attr("MAX_CTX")         = MAX_CTX;
    m.attr("MAX_BLOCK_SIZE")  = dflash_draft::MAX_BLOCK_SIZE;
    m.attr("MAX_TREE_BUDGET") = MAX_TREE_BUDGET;
    m.def("engine_params", &resolve, py::arg("model"), py::arg("draft"), py::arg("n_ctx"), py::arg("kv_type"),
          py::arg("n_ubatch") = 0, py::arg("block_size") = 0, py::arg("tree_budget") = 0,
          py::arg("draft_window") = 4096, py::arg("spec_mode") = "auto", py::arg("ngram") = false,
          py::arg("mtp") = "off",
          "Every argument of the Session and DraftSession a load opens (decode/engine_params.h), from a Model, a "
          "DraftModel (or None) and the options checked by pydflash.Model (0: the default; n_ubatch 0: 'auto', "
          "sized for the largest of ubatch_candidates; ngram: n-gram lookup drafts, whose NgramDrafter arguments "
          "come back as 'ngram'; mtp: 'on', 'if_present' (the target's own MTP head drafts where the file has one "
          "and nothing else was asked for) or 'off', its MtpDrafter arguments as 'mtp').");
}

}  // namespace pdf::bindings
