// Calls that exist for the tests only: the pieces of the decode loop run alone (the greedy pick, the DDTree
// builder, auto's per-round choice, one draw of the sampler, a drafter's block), and reads of a session's
// committed state. pydflash itself never calls them.
#include "bindings/common.h"
#include "core/graph_cache.h"
#include "decode/round_trace.h"
#include "decode/tree.h"
#include "models/argmax.h"
#include "state/recurrent_state.h"
#include "state/step_plan.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace pdf::bindings {

using f32_array = py::array_t<float, py::array::c_style | py::array::forcecast>;

// rows [first, first + n) of a 2-D state tensor, as raw bytes [n, row bytes]
static py::array_t<uint8_t> tensor_rows(const ggml_tensor * t, int64_t first, int64_t n) {
    py::array_t<uint8_t> out({(py::ssize_t) n, (py::ssize_t) t->nb[1]});
    ggml_backend_tensor_get(t, out.mutable_data(), (size_t) first * t->nb[1], (size_t) n * t->nb[1]);
    return out;
}

static py::array_t<float> f32_rows(const ggml_tensor * t, const std::vector<int32_t> & rows) {
    py::array_t<float> out({(py::ssize_t) rows.size(), (py::ssize_t) t->ne[0]});
    for (size_t i = 0; i < rows.size(); ++i) {
        ggml_backend_tensor_get(t, out.mutable_data() + i * t->ne[0], (size_t) rows[i] * t->nb[1], t->nb[1]);
    }
    return out;
}

static std::vector<int32_t> argmax_rows(f32_array logits, int64_t n_threads, bool stock) {
    checked("n_threads", n_threads, 1, 1 << 12);
    if (logits.ndim() != 2) {
        throw std::invalid_argument("argmax_rows: logits must be 2-D (n_rows, n_vocab)");
    }
    const float * data = logits.data();
    std::vector<int32_t> out;
    {
        py::gil_scoped_release nogil;
        out = argmax_rows_on_cpu(data, logits.shape(0), logits.shape(1), (int) n_threads, stock);
    }
    return out;
}

using i32_array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// DFlash2's conditional ranks (state/draft_session.h draft_proposals): all_ids [P, all_k], child_rank and
// child_logprob [P, all_k, k]
static void set_conditional(draft_proposals & p, const py::object & all_ids_in, const py::object & rank_in,
                            const py::object & logprob_in) {
    if (all_ids_in.is_none()) {
        return;
    }
    const i32_array all_ids = all_ids_in.cast<i32_array>(), rank = rank_in.cast<i32_array>();
    const f32_array logprob = logprob_in.cast<f32_array>();
    if (all_ids.ndim() != 2 || all_ids.shape(0) != p.n_positions || all_ids.shape(1) < p.top_k || rank.ndim() != 3 ||
        rank.shape(0) != p.n_positions || rank.shape(1) != all_ids.shape(1) || rank.shape(2) != p.top_k ||
        logprob.ndim() != 3 || logprob.size() != rank.size()) {
        throw std::invalid_argument("build_draft_tree: all_ids must be (positions, all_k >= k), child_rank and "
                                    "child_logprob (positions, all_k, k)");
    }
    p.all_k = (int) all_ids.shape(1);
    p.all_ids.assign(all_ids.data(), all_ids.data() + all_ids.size());
    p.child_rank.assign(rank.data(), rank.data() + rank.size());
    p.child_logprob.assign(logprob.data(), logprob.data() + logprob.size());
    for (int32_t r : p.child_rank) {
        checked("child_rank", r, 0, p.all_k - 1);
    }
}

static py::tuple draft_tree_of(i32_array ids, f32_array logprobs, int64_t root, int64_t budget, int64_t max_depth,
                               const std::string & seed, const py::object & all_ids, const py::object & child_rank,
                               const py::object & child_logprob) {
    checked("root", root, 0, INT32_MAX);
    checked("budget", budget, 0, 1 << 16);
    checked("max_depth", max_depth, 0, 1 << 16);
    // ids, logprobs: [positions, k], most likely first per position
    if (ids.ndim() != 2 || logprobs.ndim() != 2 || ids.shape(0) != logprobs.shape(0) ||
        ids.shape(1) != logprobs.shape(1) || ids.shape(1) < 1) {
        throw std::invalid_argument("build_draft_tree: ids and logprobs must both be (positions, k >= 1)");
    }
    draft_proposals p;
    p.n_positions = (int) ids.shape(0);
    p.top_k       = (int) ids.shape(1);
    p.ids.assign(ids.data(), ids.data() + ids.size());
    p.logprobs.assign(logprobs.data(), logprobs.data() + logprobs.size());
    set_conditional(p, all_ids, child_rank, child_logprob);
    draft_tree t;
    build_draft_tree(p, (int32_t) root, (int) budget, (int) max_depth, parse_tree_seed(seed), t);
    return py::make_tuple(t.tokens, t.parents, t.depth, t.logq);
}

// a tree [root, nodes...] given by parents (parents before children), ranks and the drafter's log-probabilities;
// costs: ms per verify width, calibrated (widths of the cost model's grid)
static int verify_budget(const std::vector<int32_t> & parents, const std::vector<int32_t> & rank,
                         const std::vector<float> & logp, const std::map<int, double> & verify_ms,
                         const std::map<int, double> & tree_verify_ms, double spec_rate, bool recurrent,
                         bool grid_widths, int max_width, int row_tile) {
    if (parents.empty() || rank.size() != parents.size() || logp.size() != parents.size()) {
        throw std::invalid_argument("choose_verify_budget: parents, rank and logp need one entry per node");
    }
    if (row_tile < 1) {
        throw std::invalid_argument("choose_verify_budget: row_tile must be >= 1, got " + std::to_string(row_tile));
    }
    draft_tree t;
    t.reset(0);
    for (size_t i = 1; i < parents.size(); ++i) {
        if (parents[i] < 0 || parents[i] >= (int) i) {
            throw std::invalid_argument("choose_verify_budget: a parent must be an earlier node");
        }
        t.add(0, parents[i], rank[i], logp[i]);
    }
    if (max_width <= 0) {
        max_width = verify_ms.empty() ? 1 : verify_ms.rbegin()->first;
    }
    cost_model costs(max_width);
    for (const auto & kv : verify_ms) {
        costs.calibrate_verify(kv.first, false, kv.second);
    }
    for (const auto & kv : tree_verify_ms) {
        costs.calibrate_verify(kv.first, true, kv.second);
    }
    costs.set_spec_round(spec_rate, 1.0);  // (tokens per ms)
    costs.set_grid_widths(grid_widths);
    costs.set_row_tile(row_tile);
    acceptance_model acceptance;  // the prior: the drafter's probabilities, binned
    return choose_verify_budget(t, costs, acceptance, recurrent);
}

// whether a proposer drafting a chain step by step drafts on (decode/proposer.h worth_drafting_on): the chain's
// drafts each with P(accepted | parent accepted) p_accept, costs calibrated at verify_ms
static bool drafts_on(const std::vector<double> & p_accept, const std::map<int, double> & verify_ms,
                      double step_ms, int max_more, double spec_rate, int max_width) {
    if (verify_ms.empty() || max_width < verify_ms.rbegin()->first) {
        throw std::invalid_argument("worth_drafting_on: verify_ms needs widths up to max_width");
    }
    draft_tree chain;
    chain.reset(0);
    std::vector<double> p(1, 1.0);
    for (size_t i = 0; i < p_accept.size(); ++i) {
        chain.add(0, (int) i, 0, 0.0f);
        p.push_back(p_accept[i]);
    }
    cost_model costs(max_width);
    for (const auto & [w, ms] : verify_ms) {
        costs.calibrate_verify(w, false, ms);
    }
    costs.set_spec_round(spec_rate, 1.0);  // (tokens per ms)
    return worth_drafting_on(chain, p, costs, step_ms, max_more);
}

// a traced round's models (decode/proposer.h drafted_models) by name
static py::tuple drafted_model_names(int models) {
    py::list names;
    for (const auto & [bit, name] : {std::pair{1, "dflash"}, std::pair{2, "mtp"}}) {
        if (models & bit) {
            names.append(name);
        }
    }
    return py::tuple(names);
}

// auto's cool-down (decode/proposer.h judge_speculation) over chain rounds, each (width, drafted, committed, ms:
// a drafted round's whole time, its verify taking the measured time of its width; a plain round's step), from a
// state whose cool-down length was restored as cool_len and whose chain widths are measured at verify_ms. Each
// drafted round is chosen while the acceptance model is learnt or not (acceptance_model::learnt), as the
// proposers report it, and then learns from its chain (its accepted drafts, and the first rejected one);
// learnt=True starts with a model that has tried 64 nodes. After each round: (plain rounds left, the next
// cool-down's length)
static std::vector<std::pair<int, int>> judge_rounds(const std::vector<std::tuple<int, bool, int, double>> & rounds,
                                                     const std::map<int, double> & verify_ms, int cool_len,
                                                     bool learnt) {
    if (verify_ms.empty()) {
        throw std::invalid_argument("judge_rounds: verify_ms needs the measured widths, 1 included");
    }
    speculation_state state(verify_ms.rbegin()->first);
    for (const auto & [w, ms] : verify_ms) {
        state.costs.calibrate_verify(w, false, ms);
    }
    for (int i = 0; learnt && i < 64; ++i) {
        state.acceptance.observe(1, 0, 0.5, 0.5);
    }
    state.cool_len = cool_len;
    std::vector<std::pair<int, int>> out;
    for (const auto & [width, drafted, committed, ms] : rounds) {
        // a plain round counts the cool-down down; a drafted one must be allowed to draft
        if (sits_out_round(state) == drafted) {
            throw std::invalid_argument(format("judge_rounds: round %zu %s, but the cool-down has %d rounds left",
                                               out.size(), drafted ? "drafts" : "does not draft", state.cooldown));
        }
        const double verify = drafted ? state.costs.verify_ms(width, false) : ms;
        state.costs.observe({width, false, verify, drafted, ms - verify, committed, ms, !state.acceptance.learnt()});
        for (int d = 1; drafted && d < width && d <= committed; ++d) {
            state.acceptance.observe(d, 0, 0.5, d < committed ? 1.0 : 0.0);
        }
        if (drafted) {
            judge_speculation(state);
        }
        out.emplace_back(state.cooldown, state.cool_len);
    }
    return out;
}

// steps measured before, each (its parts' rows, its ms[, learn]), into a batch's step times (state/step_times.h)
static step_times times_of(const py::list & steps) {
    step_times times;
    for (const py::handle & step : steps) {
        const py::tuple        t     = py::cast<py::tuple>(step);
        const std::vector<int> rows  = t.size() >= 2 ? py::cast<std::vector<int>>(t[0]) : std::vector<int>{};
        const double           ms    = t.size() >= 2 ? py::cast<double>(t[1]) : 0.0;
        const bool             learn = t.size() == 3 ? py::cast<bool>(t[2]) : true;
        if (t.size() > 3 || rows.empty() || std::any_of(rows.begin(), rows.end(), [](int n) { return n < 1; }) ||
            !(ms > 0)) {
            throw std::invalid_argument("step_times: a step is its parts' rows (each >= 1), its ms (> 0) and "
                                        "optionally whether it is learnt");
        }
        times.split(rows, ms, learn);
    }
    return times;
}

static std::vector<double> split_step(const py::list & measured,
                                      const std::vector<int> & rows, double ms, bool learn) {
    step_times times = times_of(measured);
    if (rows.empty() || std::any_of(rows.begin(), rows.end(), [](int n) { return n < 1; })) {
        throw std::invalid_argument("split_step: rows must be one count (>= 1) per part");
    }
    return times.split(rows, ms, learn);
}

static std::vector<int> plan_batch_step(const std::vector<std::vector<double>> & offers, int n_parts, int n_rows,
                                        const py::list & measured, int row_tile) {
    if (row_tile < 1) {
        throw std::invalid_argument("plan_step: row_tile must be >= 1, got " + std::to_string(row_tile));
    }
    const step_times                         times = times_of(measured);
    std::vector<const std::vector<double> *> gains;
    for (const auto & o : offers) {
        gains.push_back(&o);
    }
    fixed_parts fixed;
    fixed.parts = n_parts;
    fixed.rows  = n_rows;
    return plan_step(gains, fixed, times, row_tile).widths;
}

static py::dict sample(f32_array logits, py::object sampling, py::object history_in, int64_t t) {
    if (logits.ndim() != 1 || logits.shape(0) < 1) {
        throw std::invalid_argument("sample: logits must be one non-empty row");
    }
    const int64_t              V       = logits.shape(0);
    const std::vector<int32_t> history = int32_array("history", history_in);
    for (int32_t h : history) {
        checked("history token", h, 0, V - 1);
    }
    token_sampler smp(parse_sampling(sampling, V), V, (int) std::max<size_t>(1, history.size()));
    smp.set_history(history.data(), (int) history.size());
    const int32_t token = smp.sample(logits.data(), (uint64_t) checked("t", t, 0, INT64_MAX));
    const auto    dist  = smp.distribution();
    py::array_t<int32_t> ids((py::ssize_t) dist.size());
    py::array_t<double>  probs((py::ssize_t) dist.size());
    for (size_t i = 0; i < dist.size(); ++i) {
        ids.mutable_data()[i]   = dist[i].first;
        probs.mutable_data()[i] = dist[i].second;
    }
    py::dict d;
    d["token"] = token;
    d["ids"]   = ids;
    d["probs"] = probs;
    if (smp.params().n_logprobs >= 0) {
        d["logprobs"] = logprobs_dict({smp.logprobs()});
    }
    return d;
}

// the committed state as the next evaluation reads it: K and V rows of the committed slots (raw bytes, per
// attention layer), the SSM state and conv window (per recurrent layer)
static py::dict read_state(const session & s) {
    py::dict   d;
    py::list   k, v, ssm, conv;
    const auto & info = s.model().info();
    for (const kv_layer_desc & l : info.kv_layers) {
        k.append(tensor_rows(s.kv().k(l.il), 0, s.n_past()));
        v.append(tensor_rows(s.kv().v(l.il), 0, s.n_past()));
    }
    if (const recurrent_state * rs = s.recurrent()) {
        for (const recurrent_layer_desc & l : info.recurrent_layers) {
            ssm.append(f32_rows(rs->ssm(l.il), {rs->ssm_row()}).attr("reshape")(-1));
            conv.append(f32_rows(rs->conv(l.il), rs->conv_rows()));
        }
    }
    d["k"] = k;
    d["v"] = v;
    d["ssm"] = ssm;
    d["conv"] = conv;
    return d;
}

static py::array_t<float> ssm_state(const session & s, int64_t il) {
    const recurrent_state * rs = s.recurrent();
    if (!rs) {
        throw std::invalid_argument("ssm_state: the model has no recurrent layers");
    }
    const model_info & info = s.model().info();
    const auto it = std::find_if(info.recurrent_layers.begin(), info.recurrent_layers.end(),
                                 [il](const recurrent_layer_desc & l) { return l.il == il; });
    if (it == info.recurrent_layers.end()) {
        throw std::out_of_range(format("ssm_state: layer %lld is not a recurrent layer",
                                       (long long) il));
    }
    ggml_tensor *             t = rs->ssm((int) il);
    py::array_t<float>        out(it->ssm_size);
    ggml_backend_tensor_get(t, out.mutable_data(), (size_t) rs->ssm_row() * t->nb[1],
                            it->ssm_size * sizeof(float));
    return out;
}

// feats [m, n_ext*E] of context rows not yet appended (any number: appended in chunks first)
static py::object draft_block(py_draft & pd, f32_array feats, py::object positions_in, int64_t anchor, int64_t start,
                              bool with_logprobs) {
    draft_session &            d         = *pd.session;
    const std::vector<int32_t> positions = int32_array("positions", positions_in);
    const int                  m         = (int) positions.size();
    checked("anchor", anchor, 0, INT32_MAX);  // (the vocabulary bound: draft_session::draft)
    checked("start", start, 0, INT32_MAX);
    if (feats.ndim() != 2 || feats.shape(0) != m) {
        throw std::invalid_argument("draft: feats must be (len(positions), n_ext * n_embd)");
    }
    if (m > 0 && feats.shape(1) != d.ring().row_width()) {
        throw std::invalid_argument(format("draft: feats rows have %lld floats, the drafter reads %lld",
                                           (long long) feats.shape(1), (long long) d.ring().row_width()));
    }
    draft_proposals out;
    {
        py::gil_scoped_release nogil;
        // through the ring, in pieces it can hold, like the target's own writes; positions missing between two
        // given ones or before start are skipped (draft_session::skip: evaluated without capture)
        for (int i = 0, k = 0; i < m; i += k) {
            if (positions[i] > d.n_valid()) {
                d.skip(d.n_valid(), positions[i] - d.n_valid());
            }
            k = 1;
            while (i + k < m && k < d.ring().capacity() && positions[i + k] == positions[i + k - 1] + 1) {
                ++k;
            }
            d.flush();
            d.ring().write(feats.data() + (size_t) i * feats.shape(1), positions.data() + i, k);
            std::vector<int32_t> rows(k);
            for (int j = 0; j < k; ++j) {
                rows[j] = d.ring().slot(positions.data()[i + j]);
            }
            d.queue(rows.data(), positions.data() + i, k);
        }
        if (start > d.n_valid()) {
            d.skip(d.n_valid(), (int) start - d.n_valid());
        }
        out = d.draft((int32_t) anchor, (int) start);
    }
    if (!with_logprobs) {
        std::vector<int32_t> top1(out.n_positions);
        for (int i = 0; i < out.n_positions; ++i) {
            top1[i] = out.id(i, 0);
        }
        return py::cast(top1);
    }
    py::array_t<int32_t> ids({out.n_positions, out.top_k});
    py::array_t<float>   lps({out.n_positions, out.top_k});
    std::copy(out.ids.begin(), out.ids.end(), ids.mutable_data());
    std::copy(out.logprobs.begin(), out.logprobs.end(), lps.mutable_data());
    return py::make_tuple(ids, lps);
}

// auto's cost model, per-round choice and cool-down, and the batch's plan, on hand-made costs
static void register_cost_hooks(py::module_ & m) {
    m.def("learnt_verify_ms", [](const std::vector<std::pair<int, double>> & rounds, int max_width, bool grid_widths) {
        if (max_width < 1) {
            throw std::invalid_argument("learnt_verify_ms: max_width must be positive");
        }
        cost_model costs(max_width);
        costs.set_grid_widths(grid_widths);
        for (const auto & [width, ms] : rounds) {
            costs.observe({width, false, ms, false, 0.0, 1, ms});
        }
        std::map<int, double> out;
        for (int w : costs.grid()) {
            out[w] = costs.verify_ms(w, false);
        }
        return out;
    }, py::arg("rounds"), py::arg("max_width"), py::arg("grid_widths") = false,
       "A fresh cost model's chain verify times at its grid widths after observing these plain or undrafted "
       "rounds [(width, ms)], in order (decode/cost_model.h; grid_widths: as on a GPU).");
    m.def("force_grid_widths", [](const py::object & on) {
        cost_model::force_grid_widths(on.is_none() ? -1 : on.cast<bool>() ? 1 : 0);
    }, py::arg("on"), "Every generation from now on verifies only its cost grid's widths (True) or any width "
                      "(False); None: as its target computes (grid widths on a GPU).");
    m.def("choose_verify_budget", &verify_budget,
          py::arg("parents"), py::arg("rank"), py::arg("logp"), py::arg("verify_ms"),
          py::arg("tree_verify_ms") = std::map<int, double>{}, py::arg("spec_rate") = 0.0, py::arg("recurrent") = false,
          py::arg("grid_widths") = false, py::arg("max_width") = 0, py::arg("row_tile") = 1,
          "auto's per-round choice (decode/proposer.h) with the given costs and an untrained acceptance model "
          "(grid_widths: as on a GPU, decode/cost_model.h; max_width: the widest verify, 0: verify_ms's widest; "
          "row_tile: the target's, models/model.h).");
    m.def("worth_drafting_on", &drafts_on, py::arg("p_accept"), py::arg("verify_ms"), py::arg("step_ms"),
          py::arg("max_more"), py::arg("spec_rate") = 0.0, py::arg("max_width") = 16,
          "Whether the MTP head drafts on after the chain of drafts with these P(accepted | parent accepted), "
          "chain verifies measured at verify_ms, each further draft step_ms, at most max_more more "
          "(decode/proposer.h worth_drafting_on).");
    m.def("judge_rounds", &judge_rounds, py::arg("rounds"), py::arg("verify_ms"), py::arg("cool_len") = 0,
          py::arg("learnt") = true,
          "auto's cool-down after each of these chain rounds [(width, drafted, committed, round ms)], widths "
          "measured at verify_ms, the cool-down length restored as cool_len, the acceptance model learnt at the "
          "start or not: [(plain rounds left, next cool-down length)].");
    m.def("split_step", &split_step, py::arg("measured"), py::arg("rows"), py::arg("ms"), py::arg("learn") = true,
          "The ms a batched step of parts with these rows, taking ms, charges each part (state/step_times.h), after "
          "the steps `measured` ([(rows, ms[, learn]), ...]); learn=False: a step holding a prompt micro-batch.");
    m.def("plan_step", &plan_batch_step, py::arg("offers"), py::arg("fixed_parts"), py::arg("fixed_rows"),
          py::arg("measured"), py::arg("row_tile") = 1,
          "The batch's plan (state/step_plan.h): per offer (its nodes' P(reached), best first), the nodes to "
          "verify, given the step's other parts and the steps measured before ([(rows, ms), ...]), a speculative "
          "step's rows in whole row_tile; [] when no step of that many parts was.");
}

static void register_functions(py::module_ & m) {
    m.def("graph_counters", [] {
        const graph_counts c = graph_counters();
        return py::dict(py::arg("builds") = c.builds, py::arg("placements") = c.placements);
    }, "Graphs built and made resident so far, process-wide (every session's and drafter's).");
    m.def("kept_graph_memory", [] {
        const kept_graphs k = kept_graph_memory();
        return py::dict(py::arg("graphs") = k.graphs, py::arg("bytes") = k.bytes);
    }, "Graphs built and kept now, process-wide, and the host bytes their metadata holds (core/graph_cache.h).");
    m.def("trace_rounds", [](bool on) { set_round_tracing(on); }, py::arg("on"),
          "Record every decode round from now on (decode/round_trace.h); traced_rounds() hands them over.");
    m.def("traced_rounds", [] {
        py::list out;
        for (const traced_round & r : take_traced_rounds()) {
            out.append(py::dict(py::arg("width") = r.width, py::arg("tree") = r.tree, py::arg("drafted") = r.drafted,
                                py::arg("depth") = r.depth, py::arg("models") = drafted_model_names(r.models),
                                py::arg("captured") = r.captured, py::arg("committed") = r.committed,
                                py::arg("draft_ms") = r.draft_ms,
                                py::arg("verify_ms") = r.verify_ms, py::arg("builds") = r.builds,
                                py::arg("placements") = r.placements));
        }
        return out;
    }, "The rounds traced since the last call: width, tree, drafted, depth (positions drafted), models (merged "
       "proposers: the names of the models that drafted), captured (the evaluation captured the proposer's "
       "features), committed, draft_ms, verify_ms, and the graphs built and made resident during the verify.");
    m.def("argmax_rows", &argmax_rows,
          py::arg("logits"), py::arg("n_threads"), py::arg("stock") = false,
          "The greedy pick of the CPU graphs (stock=True: ggml_argmax) on a float32 (n_rows, n_vocab) array.");
    m.def("build_draft_tree", &draft_tree_of,
          py::arg("ids"), py::arg("logprobs"), py::arg("root"), py::arg("budget"), py::arg("max_depth"),
          py::arg("seed") = "best_first", py::arg("all_ids") = py::none(), py::arg("child_rank") = py::none(),
          py::arg("child_logprob") = py::none(),
          "The DDTree tree the loop verifies: (tokens, parents, depth, log Q) of [root, nodes...] in choice order; "
          "all_ids / child_rank / child_logprob: a DFlash2 selector's ranks given each previous candidate.");
    m.def("sample", &sample,
          py::arg("logits"), py::arg("sampling"), py::arg("history") = py::list(), py::arg("t") = 0,
          "One draw of the sampler chain over a row of logits, for tests: the token, the candidates it chose among "
          "(ids in id order, probabilities) and, with sampling['logprobs'], the log-probabilities. history: the "
          "tokens the penalties look back over (repeat_last_n -1 takes all of them).");
}

void register_test_hooks(py::module_ & m) {
    register_functions(m);
    register_cost_hooks(m);
    auto session_cls = py::reinterpret_borrow<py::class_<session>>(m.attr("Session"));
    session_cls.def("read_state", &read_state, "The committed KV rows and recurrent state (for tests).")
        .def("ssm_state", &ssm_state,
             py::arg("layer"), "The committed gated-delta-net state of a recurrent layer ([S*S*H_v] floats, the "
                               "fused op's layout).");
    auto draft_cls = py::reinterpret_borrow<py::class_<py_draft>>(m.attr("DraftSession"));
    draft_cls.def("draft", &draft_block,
                  py::arg("feats"), py::arg("positions"), py::arg("anchor"), py::arg("start"),
                  py::arg("with_logprobs") = false,
                  "Append context rows (a position missing between two given ones or before start: skipped, as a "
                  "target evaluation without capture leaves it) and draft one block [anchor, MASK x (B-1)] at "
                  "start; returns the B-1 proposals, or with_logprobs: (ids, logprobs) [B-1, top_k], most likely "
                  "first.")
        .def("acceptance_observed",
             [](const py_draft & d, int64_t depth, int64_t rank) {
                 const auto [tried, accepted] = d.state->acceptance.observed(
                     (int) checked("depth", depth, 1, 256), (int) checked("rank", rank, 0, INT32_MAX));
                 return py::make_tuple(tried, accepted);
             },
            py::arg("depth"), py::arg("rank"),
            "The (decayed) counts auto learnt from: drafted tokens at `depth` of `rank` tried, and accepted (summed "
            "acceptance probabilities when sampling).");
}

}  // namespace pdf::bindings
