#include "state/mtp_session.h"
#include "core/error.h"
#include "models/head.h"

#include <algorithm>
#include <atomic>
#include <tuple>
#include <cmath>

namespace pdf {

static constexpr int KV_WINDOW_STEP    = 256;
static constexpr int APPEND_ROWS_SMALL = 64;
static constexpr int APPEND_ROWS_LARGE = 256;
static constexpr int MAX_RING_ROWS     = 1 << 16;
static constexpr int MAX_SAVED_STATES  = 8;

mtp_session::mtp_session(std::shared_ptr<const target_model> target, uint32_t n_ctx, const mtp_params & params,
                         std::shared_ptr<compute_backends> compute)
    : target_(std::move(target)), compute_(std::move(compute)), carry_buf_(1), arena_(*compute_),
      rows_graph_(arena_), step_graph_(arena_), append_small_(arena_), append_large_(arena_) {
    static std::atomic<uint64_t> next_id{1};
    id_ = next_id++;
    if (!target_->has_mtp()) {
        throw unsupported_error(target_->mtp_missing());
    }
    const model_info & info = target_->info();
    if (params.block < 2 || params.block > 64) {
        throw std::invalid_argument(format("MTP block_size = %d must be in [2, 64]", params.block));
    }
    if (params.ring_capacity < params.block + 1 || params.ring_capacity > MAX_RING_ROWS) {
        throw std::invalid_argument(format("MTP trunk-state ring capacity %d must be in [%d, %d]",
                                           params.ring_capacity, params.block + 1, MAX_RING_ROWS));
    }
    if (params.top_k < 1 || params.top_k > info.n_vocab || (!params.with_logprobs && params.top_k != 1)) {
        throw std::invalid_argument(format("MTP top_k = %d must be in [1, %lld] (beyond 1 with log-probabilities)",
                                           params.top_k, (long long) info.n_vocab));
    }
    block_         = params.block;
    top_k_         = params.top_k;
    with_logprobs_ = params.with_logprobs;
    n_ctx_         = (int) n_ctx;
    capture_       = {info.n_layer};
    model_info head_info = info;  // the head's one attention layer, placed with the target's last layer
    head_info.kv_layers  = {target_->mtp_kv_layer()};
    const size_t kv_bytes   = kv_cache::n_bytes_for(head_info, n_ctx, params.type_k, params.type_v);
    const size_t ring_bytes = (size_t) params.ring_capacity * info.n_embd * sizeof(float);
    const size_t have       = target_->devices().free_memory(info.n_layer - 1);
    if (kv_bytes + ring_bytes > have) {
        throw context_overflow_error(format("the MTP head's cache (n_ctx %u: %.1f MiB) and trunk-state ring (%.1f "
                                            "MiB) need more than the %.1f MiB that are free; lower n_ctx", n_ctx,
                                            kv_bytes / 1048576.0, ring_bytes / 1048576.0, have / 1048576.0),
                                     0, n_ctx);
    }
    ring_ = std::make_unique<feature_ring>(target_->devices(), info.n_layer - 1, 1, info.n_embd,
                                           params.ring_capacity);
    // the target session's types: at n_ctx the head's one layer is as large as one of the target's
    kv_    = std::make_unique<kv_cache>(head_info, target_->devices(), n_ctx, params.type_k, params.type_v,
                                        info.n_layer - 1);
    carry_ = carry_buf_.add(GGML_TYPE_F32, info.n_embd, 1, "mtp_carry",
                            target_->devices().state_buft(info.n_layer - 1));
    if (carry_buf_.allocate()) {
        throw backend_error("could not allocate the MTP head's carried state");
    }
    arena_.sched_for(target_->mtp_graph_nodes());
}

mtp_session::~mtp_session() = default;

int mtp_session::window_step() { return KV_WINDOW_STEP; }

size_t mtp_session::measure(int n_kv) {
    if (n_kv < 1 || n_kv > n_ctx_) {
        throw std::invalid_argument(format("measure: n_kv = %d, expected 1..%d", n_kv, n_ctx_));
    }
    size_t most = 0;
    for (auto [rows, carry, head] : {std::tuple{block_, false, true}, std::tuple{1, true, true},
                                     std::tuple{APPEND_ROWS_SMALL, false, false},
                                     std::tuple{APPEND_ROWS_LARGE, false, false}}) {
        graph g(arena_);
        build(g, rows, carry, head, n_kv);
        most = std::max(most, g.cache.measure());
    }
    return most;
}

int mtp_session::window_for(int last_position) const {
    return std::min(n_ctx_, (int) GGML_PAD(last_position + 1, KV_WINDOW_STEP));
}

void mtp_session::build(graph & g, int n_rows, bool from_carry, bool with_head, int n_kv) {
    ggml_context * ctx = g.cache.begin(target_->mtp_graph_nodes());
    ggml_cgraph *  gf  = g.cache.graph();
    g.in               = eval_inputs{};
    g.in.n_tokens      = n_rows;
    g.in.tokens        = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_rows);
    g.in.positions     = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) n_rows * target_->info().n_pos_per_token);
    ggml_set_input(g.in.tokens);
    ggml_set_input(g.in.positions);
    kv_->add_inputs(ctx, g.in.kv, n_rows, n_kv);
    ggml_tensor * h = nullptr;  // [E, n_rows]: the state each row starts from
    g.ring_rows     = nullptr;
    if (from_carry) {
        h = carry_;
    } else {
        g.ring_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_rows);
        ggml_set_input(g.ring_rows);
        // the ring holds the last layer's output; the trunk's state is after the final norm
        h = target_->build_output_norm(ctx, ggml_get_rows(ctx, ring_->rows(), g.ring_rows));
    }
    state_tensors st;
    kv_->fill(st, target_->mtp_kv_layer().il + 1);
    // [E, 1]: the last row's h' (the other rows' K/V written); without the head only those writes are computed
    ggml_tensor * last = target_->build_mtp(ctx, gf, g.in, st, h, n_rows > 1);
    g.top_ids = g.top_logprobs = nullptr;
    if (with_head) {
        ggml_build_forward_expand(gf, ggml_cpy(ctx, last, carry_));
        const head_outputs head = build_top_k_readout(ctx, gf, target_->mtp_output_head(), last,
                                                      target_->head_on_host(), top_k_, with_logprobs_);
        g.top_ids      = head.top_ids;
        g.top_logprobs = head.top_logprobs;
    }
    g.key_rows  = n_rows;
    g.key_carry = from_carry;
    g.key_head  = with_head;
    g.key_kv    = n_kv;
}

// tokens, positions (M-RoPE: the text sections all take the position), their slots and, with the head, the last
// row's mask (the other rows only write their K/V; padding rows go to slot 0, which no real row sees)
void mtp_session::set_common(graph & g, const std::vector<int32_t> & tokens, const std::vector<int32_t> & pos) {
    const int n = (int) tokens.size(), n_pos = target_->info().n_pos_per_token, n_kv = g.key_kv;
    std::vector<int32_t>     pos_host((size_t) n * n_pos, 0);
    std::vector<int64_t>     slots(n);
    for (int i = 0; i < n; ++i) {
        for (int j = 0; j < std::min(n_pos, 3); ++j) {
            pos_host[(size_t) j * n + i] = pos[i];
        }
        slots[i] = pos[i];
    }
    ggml_backend_tensor_set(g.in.tokens, tokens.data(), 0, sizeof(int32_t) * n);
    ggml_backend_tensor_set(g.in.positions, pos_host.data(), 0, sizeof(int32_t) * pos_host.size());
    ggml_backend_tensor_set(g.in.kv.slots, slots.data(), 0, sizeof(int64_t) * n);
    if (!g.key_head) {
        return;  // a graph that only appends reads no attention
    }
    // the last row alone queries (build_mtp's last_only)
    const std::vector<ggml_fp16_t> mask = causal_mask({pos[n - 1]}, n_kv);
    ggml_backend_tensor_set(g.in.kv.kq_mask, mask.data(), (size_t) (n - 1) * n_kv * sizeof(ggml_fp16_t),
                            sizeof(ggml_fp16_t) * mask.size());
}

std::vector<ggml_fp16_t> mtp_session::causal_mask(const std::vector<int32_t> & positions, int n_kv) {
    std::vector<ggml_fp16_t> mask(positions.size() * (size_t) n_kv, ggml_fp32_to_fp16(-INFINITY));
    for (size_t i = 0; i < positions.size(); ++i) {
        ggml_fp16_t * row = mask.data() + i * n_kv;
        std::fill(row + (positions[i] == 0 ? 0 : 1), row + positions[i] + 1, ggml_fp32_to_fp16(0.0f));
    }
    return mask;
}

mtp_session::step_rows mtp_session::rows_of(int m, int n_rows, bool with_anchor, int32_t anchor, int start,
                                            int h_row) const {
    step_rows r;
    r.n_queued    = m;
    const int pad = n_rows - m - (with_anchor ? 1 : 0);
    auto row = [&r](int32_t token, int position, int ring_row) {
        r.tokens.push_back(token);
        r.positions.push_back(position);
        r.ring_rows.push_back(ring_row);
    };
    for (int i = 0; i < n_rows; ++i) {
        const int q = i - pad;  // padding first: the real rows end the batch (the anchor's last)
        if (q < 0) {
            row(0, 0, with_anchor ? h_row : queued_h_[0]);
        } else if (q < m) {
            row(queued_tok_[q], queued_pos_[q], queued_h_[q]);
        } else {
            row(anchor, start, h_row);
        }
    }
    return r;
}

// rows from the ring: with_head the round's graph (the queue and the anchor), else an append graph
void mtp_session::run_rows(const step_rows & r, bool with_head) {
    const int n_rows = (int) r.tokens.size();
    const int n_kv   = window_for(r.positions.back());
    graph &   g      = with_head ? rows_graph_ : n_rows <= APPEND_ROWS_SMALL ? append_small_ : append_large_;
    if (!(g.cache.ready() && g.key_rows == n_rows && g.key_kv == n_kv)) {
        build(g, n_rows, false, with_head, n_kv);
    }
    g.cache.allocate("the MTP graph");
    set_common(g, r.tokens, r.positions);
    ggml_backend_tensor_set(g.ring_rows, r.ring_rows.data(), 0, sizeof(int32_t) * n_rows);
    g.cache.compute("the MTP graph");
    appended(r.n_queued);
    if (with_head) {
        read_step(g.top_ids, g.top_logprobs, 0, 0);
    }
}

void mtp_session::appended(int m) {
    if (m > 0) {
        n_valid_ = queued_pos_[m - 1] + 1;
    }
    queued_tok_.erase(queued_tok_.begin(), queued_tok_.begin() + m);
    queued_pos_.erase(queued_pos_.begin(), queued_pos_.begin() + m);
    queued_h_.erase(queued_h_.begin(), queued_h_.begin() + m);
}

void mtp_session::append_queued(int max_rows) {
    const int m = std::min({(int) queued_pos_.size(), max_rows, APPEND_ROWS_LARGE});
    run_rows(rows_of(m, m <= APPEND_ROWS_SMALL ? APPEND_ROWS_SMALL : APPEND_ROWS_LARGE, false, 0, 0, 0), false);
}

void mtp_session::read_step(ggml_tensor * top_ids, ggml_tensor * top_logprobs, int column, int step) {
    int32_t *    ids = proposals_.ids.data() + (size_t) step * top_k_;
    float *      lps = proposals_.logprobs.data() + (size_t) step * top_k_;
    const size_t n   = sizeof(int32_t) * top_k_;
    ggml_backend_tensor_get(top_ids, ids, (size_t) column * n, n);
    if (top_logprobs) {
        ggml_backend_tensor_get(top_logprobs, lps, (size_t) column * top_k_ * sizeof(float), sizeof(float) * top_k_);
    } else {
        std::fill(lps, lps + top_k_, 0.0f);
    }
    sort_top_k(ids, lps, 1, top_k_);
    proposals_.n_positions = step + 1;
}

const draft_proposals & mtp_session::draft(int32_t anchor, int start, int h_row, int n_steps) {
    if (n_steps < 1 || n_steps > block_ - 1) {
        throw std::invalid_argument(format("MTP draft: %d steps, expected 1..%d", n_steps, block_ - 1));
    }
    begin(anchor, start, h_row);
    while (proposals_.n_positions < n_steps) {
        next();
    }
    return proposals_;
}

mtp_session::step_rows mtp_session::prepare_begin(int32_t anchor, int start, int h_row) {
    if (start < 1 || start + 1 >= n_ctx_) {
        throw std::invalid_argument(format("MTP draft at position %d, expected 1..%d", start, n_ctx_ - 2));
    }
    if (anchor < 0 || anchor >= target_->info().n_vocab || h_row < 0 || h_row >= ring_->capacity()) {
        throw std::out_of_range(format("MTP draft: anchor token %d or ring row %d out of range", anchor, h_row));
    }
    const int m_fits = block_ - 1;  // queued rows the round's own graph appends
    while ((int) queued_pos_.size() > m_fits) {
        append_queued((int) queued_pos_.size() - m_fits);
    }
    if (n_valid() != start) {
        throw std::invalid_argument(format("MTP draft: rows exist up to position %d, the anchor is at %d", n_valid(),
                                           start));
    }
    start_                 = start;
    proposals_.n_positions = 0;
    proposals_.top_k       = top_k_;
    proposals_.ids.assign((size_t) (block_ - 1) * top_k_, 0);
    proposals_.logprobs.assign(proposals_.ids.size(), 0.0f);
    return rows_of((int) queued_pos_.size(), block_, true, anchor, start, h_row);
}

const draft_proposals & mtp_session::begin(int32_t anchor, int start, int h_row) {
    run_rows(prepare_begin(anchor, start, h_row), true);
    return proposals_;
}

mtp_session::step_rows mtp_session::prepare_next() const {
    const int i = proposals_.n_positions;
    if (i < 1 || i >= block_ - 1 || start_ + i + 1 >= n_ctx_) {
        throw std::invalid_argument(format("MTP draft: step %d after %d (at most %d a round, within n_ctx %d)", i + 1,
                                           i, block_ - 1, n_ctx_));
    }
    step_rows r;
    r.tokens    = {proposals_.id(i - 1, 0)};
    r.positions = {start_ + i};
    return r;
}

const draft_proposals & mtp_session::next() {
    const step_rows r    = prepare_next();
    const int       n_kv = window_for(r.positions[0]);
    graph &         g    = step_graph_;
    if (!(g.cache.ready() && g.key_kv == n_kv)) {
        build(g, 1, true, true, n_kv);
    }
    g.cache.allocate("the MTP step graph");
    set_common(g, r.tokens, r.positions);
    g.cache.compute("the MTP step graph");
    read_step(g.top_ids, g.top_logprobs, 0, proposals_.n_positions);
    return proposals_;
}

void mtp_session::queue(int32_t token, int position, int h_row) {
    if (h_row < 0 || h_row >= ring_->capacity() || token < 0 || token >= target_->info().n_vocab) {
        throw std::out_of_range(format("MTP: token %d or ring row %d out of range", token, h_row));
    }
    if (position != n_valid() || position < 1 || position >= n_ctx_) {
        throw std::invalid_argument(format("MTP: row of position %d does not follow the rows up to %d", position,
                                           n_valid()));
    }
    queued_tok_.push_back(token);
    queued_pos_.push_back(position);
    queued_h_.push_back(h_row);
}

void mtp_session::flush() {
    while (!queued_pos_.empty()) {
        append_queued(APPEND_ROWS_LARGE);
    }
}

void mtp_session::protect(int first, int n) {
    if (ring_->overwrites(first, n, queued_h_)) {
        flush();
    }
}

void mtp_session::save_state(int position) {
    std::vector<float> & h = saved_[position];
    h.resize(ring_->row_width());
    ggml_backend_tensor_get(ring_->rows(), h.data(), (size_t) ring_->slot(position) * ring_->rows()->nb[1],
                            h.size() * sizeof(float));
    while ((int) saved_.size() > MAX_SAVED_STATES) {
        saved_.erase(saved_.begin());
    }
}

bool mtp_session::restore_state(int position) {
    auto it = saved_.find(position);
    if (it == saved_.end()) {
        return false;
    }
    ring_->write(it->second.data(), &position, 1);
    return true;
}

void mtp_session::truncate(int n_past) {
    while (!queued_pos_.empty() && queued_pos_.back() >= n_past) {
        queued_pos_.pop_back();
        queued_tok_.pop_back();
        queued_h_.pop_back();
    }
    n_valid_ = std::max(1, std::min(n_valid_, n_past));
    saved_.erase(saved_.lower_bound(n_past), saved_.end());
}

int mtp_session::n_valid() const {
    return queued_pos_.empty() ? n_valid_ : queued_pos_.back() + 1;
}

}  // namespace pdf
