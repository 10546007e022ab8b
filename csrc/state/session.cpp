#include "state/session.h"
#include "core/error.h"
#include "core/graph_cache.h"
#include "core/log.h"
#include "models/head.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace pdf {

// The attended KV window grows in steps of kv_window_step() slots: each graph is rebuilt once per step.
// On the CPU masked slots still cost time in the small-window attention (matmul + softmax + the V transpose run
// over the whole window), so the step is small: 64 instead of 256 took ~5% off a tiny 4-layer Qwen3's decode
// step over 128 tokens (perf samples per token), while its rebuilds (~0.5 ms each there, a fifth of one step)
// cost < 0.5%. On a GPU a rebuilt graph also loses its CUDA graph: ggml runs it uncaptured once, captures it
// at its second run and replays it from the third (ggml-cuda.cu, ggml_backend_cuda_graph_compute), so every
// shape auto verifies pays that again at each step (an H200, 2026-11-27: auto's verifies 1.7-2.8x chain 4's, with
// 0.46 graph builds per evaluation); there the step is llama.cpp's KV padding, 256.
// Which attention kernel runs is still decided on 256-slot windows (models/attention.cpp).
// evaluation graphs kept built (all placed in one compute buffer, core/graph_cache.h; each keeps only its nodes'
// metadata, ~0.4 KB a node). auto verifies chains of every width up to its block and trees beside them: on the
// cost-realistic qwen35 MTP pair (widths 1-8 and a few trees) 8 kept graphs were rebuilt 105 times in 329 rounds,
// 16 kept 43 (the rest: the attended window's steps)
static constexpr size_t MAX_CACHED_GRAPHS = 16;

static std::atomic<uint64_t> next_session_id{1};

session::session(std::shared_ptr<const target_model> model, const session_params & params)
    : model_(std::move(model)), compute_(std::make_shared<compute_backends>(model_->devices())), arena_(*compute_),
      id_(next_session_id++) {
    const model_info & info = model_->info();
    if (params.n_ctx == 0 || params.n_ubatch == 0) {
        throw std::invalid_argument(format("n_ctx (%u) and n_ubatch (%u) must be positive", params.n_ctx,
                                           params.n_ubatch));
    }
    n_ubatch_ = std::min(params.n_ubatch, params.n_ctx);  // a micro-batch never holds more than the context
    const bool quiet = model_->devices().plan_only();  // a memory plan: the load it plans will say it
    if (params.n_ctx > info.n_ctx_train && info.n_ctx_train > 0 && !quiet) {
        PDF_LOG_WARN("n_ctx = %u exceeds the model's training context %u (%s); quality may degrade", params.n_ctx,
                     info.n_ctx_train, info.path.c_str());
    }
    kv_cache::check_types(info, params.type_k, params.type_v);
    const size_t kv_need = kv_cache::n_bytes_for(info, params.n_ctx, params.type_k, params.type_v);
    const size_t rs_need = info.recurrent_layers.empty() ? 0 : recurrent_state::n_bytes_for(info, params.n_rollback);
    const size_t have    = model_->devices().free_memory(info.n_layer - 1);
    if (!quiet) {
        PDF_LOG_INFO("KV cache: n_ctx = %u, K %s, V %s: %.2f MiB; recurrent state (rollback over %u tokens): "
                     "%.2f MiB", params.n_ctx, ggml_type_name(params.type_k), ggml_type_name(params.type_v),
                     kv_need / 1048576.0, params.n_rollback, rs_need / 1048576.0);
    }
    if (kv_need + rs_need > have) {
        throw context_overflow_error(format("KV cache for n_ctx = %u (%.1f MiB) and recurrent state (%.1f MiB) need "
                                            "more than the %.1f MiB that are free; lower n_ctx or use a quantized "
                                            "kv_type", params.n_ctx, kv_need / 1048576.0, rs_need / 1048576.0,
                                            have / 1048576.0),
                                     0, params.n_ctx);
    }
    kv_ = std::make_unique<kv_cache>(info, model_->devices(), params.n_ctx, params.type_k, params.type_v);
    if (!info.recurrent_layers.empty()) {
        rs_ = std::make_unique<recurrent_state>(info, model_->devices(), *compute_, params.n_rollback);
    }
    // one scheduler for every graph the session can build (a tree has at most n_rollback depths): a larger
    // graph arriving later would replace it, and its compute buffer with it
    arena_.sched_for(std::max(model_->max_graph_nodes(rs_ ? (int) rs_->n_rollback() : 0),
                              model_->max_graph_nodes(0, (int) n_ubatch_)));
}

session::~session() = default;

bool session::computes_on_gpu() const {
    return model_->devices().computes_on_gpu();
}

int session::kv_window_step() const {
    return computes_on_gpu() ? KV_WINDOW_STEP_GPU : KV_WINDOW_STEP;
}

void session::prepare_graph(const graph_key & key, const ring_set & rings) {
    ++uses_;
    for (auto & g : graphs_) {
        if (g->cache.ready() && g->key == key) {
            cur_           = g.get();
            cur_->last_use = uses_;
            cur_->cache.allocate("the compute graph");
            return;
        }
    }
    cur_ = &entry_for_new_graph(graphs_, MAX_CACHED_GRAPHS, [&] { return std::make_unique<compiled_graph>(arena_); });
    cur_->last_use = uses_;
    build_graph(*cur_, key, rings);
    cur_->cache.allocate(
        format("the compute graph for %d tokens over %d cache slots", key.n_tokens, key.n_kv).c_str());
}

void session::build_graph(compiled_graph & g, const graph_key & key, const ring_set & rings) {
    ggml_context * ctx = g.cache.begin(model_->max_graph_nodes((int) key.tree_levels.size(), key.n_tokens));
    ggml_cgraph *  gf  = g.cache.graph();
    g.in               = new_inputs(ctx, key);
    state_tensors st;
    fill_state(st);
    g.out = model_->build_eval(ctx, gf, g.in, st);
    add_head(ctx, gf, g, key.what);
    for (ggml_tensor * t : g.out.captured) {
        GGML_ASSERT(t != nullptr);
    }
    // the captured features: written into the rings by the graph itself, else read back
    g.ring_slots = {};
    if (!rings.empty() && !g.out.captured.empty()) {
        g.ring_slots = rings.add_writes(ctx, gf, g.out.captured, key.n_tokens);
    } else {
        for (ggml_tensor * t : g.out.captured) {
            ggml_set_output(t);
            ggml_build_forward_expand(gf, t);
        }
    }
    g.key = key;
}

eval_inputs session::new_inputs(ggml_context * ctx, const graph_key & key) const {
    eval_inputs in;
    in.n_tokens       = key.n_tokens;
    in.all_outputs    = key.what.all_rows;
    in.capture_layers = key.capture;
    in.tokens         = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, key.n_tokens);
    in.positions = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) key.n_tokens * model_->info().n_pos_per_token);
    ggml_set_input(in.tokens);
    ggml_set_input(in.positions);
    add_memory_inputs(ctx, key, in.kv, in.recurrent);
    return in;
}

void session::add_memory_inputs(ggml_context * ctx, const graph_key & key, kv_inputs & kv,
                                recurrent_inputs & recurrent) const {
    kv_->add_inputs(ctx, kv, key.n_tokens, key.n_kv);
    if (rs_) {
        rs_->add_inputs(ctx, recurrent, key.n_tokens, key.tree_levels, key.whole);
    }
}

void session::fill_state(state_tensors & st) const {
    const int n_layer = model_->info().n_layer;
    kv_->fill(st, n_layer);
    if (rs_) {
        rs_->fill(st, n_layer);
    }
}

void session::add_head(ggml_context * ctx, ggml_cgraph * gf, compiled_graph & g, const readout & what) const {
    const head_outputs head = build_head(ctx, model_->output_head(), g.out.hidden, model_->head_on_host(), what.top_k);
    g.argmax       = head.argmax;
    g.logits       = what.logits ? head.logits : nullptr;
    g.top_ids      = head.top_ids;
    g.top_logprobs = head.top_logprobs;
    for (ggml_tensor * t : {g.argmax, g.logits, g.top_ids, g.top_logprobs}) {
        if (t) {
            ggml_set_output(t);
            ggml_build_forward_expand(gf, t);
        }
    }
}

session::graph_key session::key_for(int n_tokens, int n_kv, const std::vector<int> & tree_levels, bool whole,
                                    const readout & what, const std::vector<int> & capture_layers,
                                    const ring_set & rings) const {
    graph_key key;
    key.n_tokens      = n_tokens;
    key.n_kv          = n_kv;
    key.what          = what;
    // a tree computes every row, reordered: the caller's last row need not be the last slot
    key.what.all_rows = what.all_rows || !tree_levels.empty();
    key.capture       = capture_layers;
    if (!capture_layers.empty()) {
        key.ring_ids = rings.ids();
    }
    key.tree_levels   = tree_levels;
    key.whole         = rs_ && tree_levels.empty() && whole;
    return key;
}

size_t session::measure_eval(int n_tokens, int n_kv, const std::vector<int> & tree_levels, bool whole,
                             const readout & what, const std::vector<int> & capture_layers,
                             const ring_set & rings) {
    compiled_graph g(arena_);
    build_graph(g, key_for(n_tokens, n_kv, tree_levels, whole, what, capture_layers, rings),
                capture_layers.empty() ? ring_set{} : rings);
    return g.cache.measure();
}

device_bytes session::compute_memory() const {
    return arena_.memory();
}

void session::rollback_pending() {
    if (!rs_ || pending_.empty()) {
        return;
    }
    if (pending_tree_) {
        rs_->commit_no_node();
    } else {
        rs_->commit((int) pending_.size(), pending_whole_, 0);
    }
}

void session::eval(const int32_t * tokens, int n, const batch_layout & layout, const readout & what,
                   const std::vector<int> & capture_layers, const ring_set & rings) {
    batch_order     order;
    const graph_key key = stage(tokens, n, layout, what, capture_layers, rings, order);
    prepare_graph(key, capture_layers.empty() ? ring_set{} : rings);
    const row_inputs where{cur_->in.tokens, cur_->in.positions, 0, n, &cur_->in.kv, &cur_->in.recurrent,
                           cur_->ring_slots};
    std::vector<int32_t> tokens_by_slot = set_inputs(tokens, n, layout, order, rings, where);
    cur_->cache.compute("the target graph");
    result_tensors r{cur_->argmax, cur_->logits, cur_->top_ids, cur_->top_logprobs, {}, 0, cur_->argmax->ne[0], 0};
    if (!cur_->ring_slots.any()) {
        r.captured = cur_->out.captured;
    }
    take_results(std::move(tokens_by_slot), order.tree(), key.whole, n, what, std::move(r));
}

session::graph_key session::stage(const int32_t * tokens, int n, const batch_layout & layout, const readout & what,
                                  const std::vector<int> & capture_layers, const ring_set & rings,
                                  batch_order & order) {
    check_batch(tokens, n, layout, what, capture_layers, rings);
    order = order_batch(n, layout.parents, rs_ != nullptr);
    if (order.tree() && (uint32_t) n > rs_->n_rollback()) {
        throw std::invalid_argument(format("eval: a tree of %d nodes needs n_rollback >= %d (the session keeps the "
                                           "state of %u)", n, n, rs_->n_rollback()));
    }
    rollback_pending();  // the last eval was never committed: start from before it
    slot_of_     = order.slot_of;
    parent_slot_ = order.parent_slot;
    // until this eval has run, there is nothing to commit (a failed allocation or compute leaves none)
    pending_.clear();
    pending_tree_    = false;
    pending_parents_ = layout.parents != nullptr;
    n_outputs_       = 0;  // no results to read until it has run
    return key_for(n, (int) std::min<uint32_t>(kv_->n_ctx(), GGML_PAD(n_past_ + n, kv_window_step())), order.levels,
                   layout.whole, what, capture_layers, rings);
}

void session::take_results(std::vector<int32_t> tokens_by_slot, bool tree, bool whole, int n, const readout & what,
                           result_tensors results) {
    results_       = std::move(results);
    pending_       = std::move(tokens_by_slot);
    pending_tree_  = tree;
    pending_whole_ = whole;
    read_outputs(n, what);
}

void session::check_batch(const int32_t * tokens, int n, const batch_layout & layout, const readout & what,
                          const std::vector<int> & capture_layers, const ring_set & rings) const {
    const model_info & info = model_->info();
    if (n <= 0) {
        throw std::invalid_argument("eval: no tokens");
    }
    if ((uint32_t) (n_past_ + n) > kv_->n_ctx()) {
        throw context_overflow_error(format("eval: %d committed + %d new tokens exceed n_ctx = %u", n_past_, n,
                                            kv_->n_ctx()),
                                     n_past_ + n, kv_->n_ctx());
    }
    for (int i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= info.n_vocab) {
            throw std::out_of_range(format("eval: token id %d at index %d is outside the vocabulary [0, %lld)",
                                           tokens[i], i, (long long) info.n_vocab));
        }
    }
    for (int c : capture_layers) {
        if (c < 0 || c > info.n_layer) {
            throw std::out_of_range(format("eval: capture layer %d is outside [0, %d]", c, info.n_layer));
        }
    }
    if (!rings.empty() && (rings.row_width() != (int64_t) capture_layers.size() * info.n_embd ||
                           n > rings.capacity())) {
        throw std::invalid_argument(format("eval: %d tokens x %zu capture layers do not fit the feature ring "
                                           "(%d rows of %lld floats)", n, capture_layers.size(), rings.capacity(),
                                           (long long) rings.row_width()));
    }
    if (what.top_k < 0 || what.top_k > info.n_vocab) {
        throw std::invalid_argument(format("eval: top_k = %d is outside [0, %lld]", what.top_k,
                                           (long long) info.n_vocab));
    }
    if (layout.mask && layout.parents) {
        throw std::invalid_argument("eval: give a mask or parents, not both");
    }
    if (layout.mask && rs_) {
        throw std::invalid_argument("eval: a recurrent model's batch is a chain or a tree (parents), not a mask");
    }
}

std::vector<int32_t> session::set_inputs(const int32_t * tokens, int n, const batch_layout & layout,
                                         const batch_order & order, const ring_set & rings,
                                         const row_inputs & where) {
    const int            n_pos = model_->info().n_pos_per_token;
    std::vector<int32_t> tokens_by_slot(n);
    std::vector<int32_t> pos_host((size_t) n * n_pos, 0);
    pending_pos_.resize(n);
    for (int s = 0; s < n; ++s) {
        const int i       = order.row_of[s];
        tokens_by_slot[s] = tokens[i];
        pending_pos_[s]   = layout.positions ? layout.positions[i] : n_past_ + (layout.parents ? order.depth[i] : i);
        // M-RoPE for text: the first three sections all take the token position, the fourth stays 0
        for (int j = 0; j < std::min(n_pos, 3); ++j) {
            pos_host[(size_t) j * n + s] = pending_pos_[s];
        }
    }
    set_graph_input(where.tokens, tokens_by_slot.data(), sizeof(int32_t) * where.first, sizeof(int32_t) * n);
    for (int j = 0; j < n_pos; ++j) {  // section-major over the whole batch
        set_graph_input(where.positions, pos_host.data() + (size_t) j * n,
                        sizeof(int32_t) * ((size_t) j * where.n_total + where.first), sizeof(int32_t) * n);
    }
    kv_->set_inputs(*where.kv, n_past_, n, layout.parents ? parent_slot_.data() : nullptr, layout.mask);
    if (rs_) {
        rs_->set_inputs(*where.recurrent, parent_slot_);
    }
    if (where.ring_rows.any()) {
        rings.set_inputs(where.ring_rows, n_past_, n);
    }
    return tokens_by_slot;
}

void session::read_outputs(int n, const readout & what) {
    // back in batch order (a reordered tree computed every row: keep what the caller asked for)
    const int n_rows = (int) results_.n_rows;
    n_outputs_       = what.all_rows ? n : 1;
    output_rows_.resize(n_outputs_);
    for (int i = 0; i < n_outputs_; ++i) {
        output_rows_[i] = n_rows == 1 ? 0 : eval_slot(what.all_rows ? i : n - 1);
    }
    std::vector<int32_t> by_slot(n_rows);
    ggml_backend_tensor_get(results_.argmax, by_slot.data(), sizeof(int32_t) * results_.first_row,
                            sizeof(int32_t) * n_rows);
    argmax_.resize(n_outputs_);
    for (int i = 0; i < n_outputs_; ++i) {
        argmax_[i] = by_slot[output_rows_[i]];
    }
    logits_.clear();
    logits_read_ = false;
    top_k_       = what.top_k;
    top_ids_.clear();
    top_logprobs_.clear();
    if (results_.top_ids) {
        read_top_k(n_rows);
    }
    read_captured(n);
}

void session::read_top_k(int n_rows) {
    const int            k = top_k_;
    std::vector<int32_t> ids((size_t) n_rows * k);
    std::vector<float>   lps((size_t) n_rows * k);
    const size_t first = (size_t) results_.first_row * k;
    ggml_backend_tensor_get(results_.top_ids, ids.data(), sizeof(int32_t) * first, sizeof(int32_t) * ids.size());
    ggml_backend_tensor_get(results_.top_logprobs, lps.data(), sizeof(float) * first, sizeof(float) * lps.size());
    top_ids_.resize((size_t) n_outputs_ * k);
    top_logprobs_.resize(top_ids_.size());
    for (int i = 0; i < n_outputs_; ++i) {
        std::copy_n(ids.data() + (size_t) output_rows_[i] * k, k, top_ids_.data() + (size_t) i * k);
        std::copy_n(lps.data() + (size_t) output_rows_[i] * k, k, top_logprobs_.data() + (size_t) i * k);
    }
    sort_top_k(top_ids_.data(), top_logprobs_.data(), n_outputs_, k);
}

void session::read_captured(int n) {
    const int64_t E = model_->info().n_embd;
    captured_.resize(results_.captured.size());
    for (size_t c = 0; c < captured_.size(); ++c) {
        captured_[c].resize((size_t) n * E);
        for (int i = 0; i < n; ++i) {
            ggml_backend_tensor_get(results_.captured[c], captured_[c].data() + (size_t) i * E,
                                    (size_t) (results_.first_token + eval_slot(i)) * E * sizeof(float),
                                    E * sizeof(float));
        }
    }
}

const std::vector<float> & session::logits() const {
    if (!logits_read_ && n_outputs_ > 0 && results_.logits) {
        const int64_t V     = model_->info().n_vocab;
        const size_t  first = (size_t) results_.first_row * V * sizeof(float);
        logits_.resize((size_t) n_outputs_ * V);
        if (slot_of_.empty() && (int) results_.n_rows == n_outputs_) {  // rows in batch order already
            ggml_backend_tensor_get(results_.logits, logits_.data(), first, sizeof(float) * logits_.size());
        } else {
            for (int i = 0; i < n_outputs_; ++i) {
                ggml_backend_tensor_get(results_.logits, logits_.data() + (size_t) i * V,
                                        first + (size_t) output_rows_[i] * V * sizeof(float), V * sizeof(float));
            }
        }
    }
    logits_read_ = true;
    return logits_;
}

const float * session::logits_row(int i) const {
    if (!results_.logits || i < 0 || i >= n_outputs_) {
        throw std::out_of_range(format("logits_row(%d): the last eval read %d rows of logits", i,
                                       results_.logits ? n_outputs_ : 0));
    }
    const int64_t V = model_->info().n_vocab;
    if (logits_read_) {
        return logits_.data() + (size_t) i * V;
    }
    logits_row_.resize((size_t) V);
    ggml_backend_tensor_get(results_.logits, logits_row_.data(),
                            (size_t) (results_.first_row + output_rows_[i]) * V * sizeof(float), V * sizeof(float));
    return logits_row_.data();
}

void session::commit(int n) {
    if (n < 0 || n > (int) pending_.size()) {
        throw std::out_of_range(format("commit: %d tokens, but the last eval had %zu", n, pending_.size()));
    }
    std::vector<int> rows(n);
    std::iota(rows.begin(), rows.end(), 0);
    commit(rows);
}

void session::commit(const std::vector<int> & rows) {
    const int n = (int) pending_.size();
    const int m = (int) rows.size();
    if (m > n) {
        throw std::out_of_range(format("commit: %d rows, but the last eval had %d", m, n));
    }
    std::vector<int> slots(m);
    for (int d = 0; d < m; ++d) {
        if (rows[d] < 0 || rows[d] >= n) {
            throw std::out_of_range(format("commit: row %d is outside the last eval's [0, %d)", rows[d], n));
        }
        slots[d] = eval_slot(rows[d]);
        if (pending_pos_[slots[d]] != n_past_ + d) {
            throw std::invalid_argument(format("commit: row %d was evaluated at position %d, but would be committed "
                                               "at %d", rows[d], pending_pos_[slots[d]], n_past_ + d));
        }
        // a recurrent state, or K/V computed over a tree, hold for a path only; other attention batches for
        // any increasing rows
        const bool follows = rs_ || pending_parents_ ? parent_slot_[slots[d]] == (d == 0 ? -1 : slots[d - 1])
                                                     : d == 0 || slots[d] > slots[d - 1];
        if (!follows) {
            throw std::invalid_argument(format("commit: rows must form a path from a depth-0 row down the tree "
                                               "(row %d does not continue row %d)", rows[d], d ? rows[d - 1] : -1));
        }
    }
    if (rs_) {
        if (m == 0) {
            rollback_pending();
        } else if (pending_tree_) {
            rs_->commit_path(std::vector<int32_t>(slots.begin(), slots.end()));
        } else {
            rs_->commit(n, pending_whole_, m);  // a chain prefix: slots[d] == d
        }
    }
    // the kept rows move to consecutive slots (below their sources, so the moves never form a cycle)
    std::vector<std::pair<int, int>> moves;
    for (int d = 0; d < m; ++d) {
        if (slots[d] != d) {
            moves.emplace_back(n_past_ + slots[d], n_past_ + d);
        }
    }
    kv_->move_rows(moves, *compute_);
    for (int d = 0; d < m; ++d) {
        tokens_.push_back(pending_[slots[d]]);
    }
    n_past_ += m;
    pending_.clear();
    slot_of_.clear();
    pending_tree_ = false;
}

void session::truncate(int n_past) {
    if (n_past < 0 || n_past > n_past_) {
        throw std::out_of_range(format("truncate: %d is outside [0, %d]", n_past, n_past_));
    }
    if (rs_ && n_past == 0) {
        rs_->reset();  // always possible, also after an uncommitted eval longer than n_rollback
    } else if (rs_ && n_past != n_past_) {
        throw std::invalid_argument(format("truncate: a recurrent state cannot be cut back to %d tokens (only "
                                           "reset to 0, or rolled back by commit after an eval)", n_past));
    } else {
        rollback_pending();
    }
    cut_history_to(n_past);
}

void session::cut_history_to(int n) {
    forget_marks_from(n);
    n_past_ = n;
    tokens_.resize(n);
    pending_.clear();
    slot_of_.clear();
    pending_tree_ = false;
}

void session::set_n_ubatch(uint32_t n) {
    if (n == 0) {
        throw std::invalid_argument("n_ubatch must be positive");
    }
    n = std::min(n, kv_->n_ctx());
    if (n != n_ubatch_) {
        if (n < n_ubatch_) {
            arena_.release();  // sized for the larger micro-batch's graphs, which will not run again
        }
        n_ubatch_      = n;
        marks_.aligned = 0;
        marks_.whole   = false;
    }
}

void session::forget_marks_from(int n_past) {
    // rows below n_past stay as they are; later evaluations overwrite the others
    if (n_past < (int) marks_.prompt.size()) {
        marks_.whole = false;
    }
    if (n_past < marks_.aligned) {
        // a hybrid model's state is kept at the mark only
        marks_.aligned = rs_ ? 0 : n_past / (int) n_ubatch_ * (int) n_ubatch_;
    }
}

void session::begin_prefill(const std::vector<int32_t> & prompt, int from) {
    marks_.prompt = prompt;
    marks_.aligned = from < (int) prompt.size() ? from : 0;
    marks_.whole   = false;
}

void session::mark_aligned(int n) {
    if (n % (int) n_ubatch_ != 0 || n != n_past_ || n > (int) marks_.prompt.size()) {
        throw std::invalid_argument(format("mark_aligned: %d tokens (n_past %d, n_ubatch %u)", n, n_past_, n_ubatch_));
    }
    marks_.aligned = n;
    if (rs_) {
        rs_->save_checkpoint(0);
    }
}

void session::mark_whole(int32_t next, std::vector<float> next_logits) {
    if (n_past_ != (int) marks_.prompt.size()) {
        throw std::invalid_argument(format("mark_whole: %d tokens committed, the prompt has %zu", n_past_,
                                           marks_.prompt.size()));
    }
    marks_.whole = true;
    marks_.next  = next;
    marks_.next_logits = std::move(next_logits);
    if (rs_) {
        rs_->save_checkpoint(1);
    }
}

void session::resume_prefill(int n) {
    const bool at_end     = marks_.whole && n == (int) marks_.prompt.size();
    const bool at_aligned = n == marks_.aligned || (!rs_ && n % (int) n_ubatch_ == 0 && n < marks_.aligned);
    if (n < 0 || n > n_past_ || !(n == 0 || at_end || at_aligned)) {
        throw std::invalid_argument(format("resume_prefill: no mark at %d (aligned %d, prompt %zu%s, n_past %d)", n,
                                           marks_.aligned, marks_.prompt.size(), marks_.whole ? "" : " not whole",
                                           n_past_));
    }
    if (rs_) {
        if (n == 0) {
            rs_->reset();
        } else {
            rs_->restore_checkpoint(at_end ? 1 : 0);
        }
    } else {
        rollback_pending();
    }
    cut_history_to(n);
}

}  // namespace pdf
