#include "state/draft_session.h"
#include "core/error.h"
#include "models/head.h"

#include <algorithm>
#include <atomic>
#include <cmath>

namespace pdf {

static constexpr int KV_WINDOW_STEP = 256;
// rows per append-only graph: a short queue in a small one, the rows queued over a stretch of plain decoding in
// a few large ones (the graph's compute overhead, not its rows, is most of an append on a small drafter)
static constexpr int APPEND_ROWS_SMALL = 64;
static constexpr int APPEND_ROWS_LARGE = 256;

// positions beyond this would overflow the padded KV windows computed from them
static constexpr int MAX_POSITION = INT32_MAX / 2;
// feature-ring rows: one target evaluation's (a prefill micro-batch, a verify)
static constexpr int MAX_RING_ROWS = 1 << 16;

static std::atomic<uint64_t> next_draft_session_id{1};

static int append_rows(int queued) {
    return queued <= APPEND_ROWS_SMALL ? APPEND_ROWS_SMALL : APPEND_ROWS_LARGE;
}

draft_session::draft_session(std::shared_ptr<const dflash_draft> draft, uint32_t n_ctx, const draft_params & params,
                             std::shared_ptr<compute_backends> compute)
    : draft_(std::move(draft)),
      id_(next_draft_session_id++),
      own_pool_(!compute),
      compute_(compute ? std::move(compute) : std::make_shared<compute_backends>(draft_->target().devices())),
      arena_(*compute_), draft_graph_(arena_), append_small_(arena_), append_large_(arena_) {
    block_ = params.block > 0 ? params.block : draft_->block_size();
    if (block_ < 2 || block_ > draft_->block_size()) {
        throw std::invalid_argument(format("block_size = %d must be in [2, %d] (the draft's trained block size)",
                                           block_, draft_->block_size()));
    }
    if (params.window <= 0 || params.ring_capacity <= 0 || params.ring_capacity > MAX_RING_ROWS) {
        throw std::invalid_argument(format("draft window (%d) must be positive and the feature ring capacity (%d) "
                                           "in [1, %d]", params.window, params.ring_capacity, MAX_RING_ROWS));
    }
    const target_model & target = draft_->target();
    if (params.top_k < 1 || params.top_k > target.info().n_vocab) {
        throw std::invalid_argument(format("draft top_k = %d must be in [1, %lld]", params.top_k,
                                           (long long) target.info().n_vocab));
    }
    if (!params.with_logprobs && params.top_k != 1) {
        throw std::invalid_argument("draft: candidates beyond the first are ranked by their log-probabilities");
    }
    top_k_         = params.top_k;
    with_logprobs_ = params.with_logprobs;
    dflash2_tree_  = params.dflash2_tree;
    window_  = (int) std::min<int64_t>(params.window, n_ctx);
    n_slots_ = window_ + block_;
    slot_pos_.assign(n_slots_, -1);
    // both buffers are sized by arguments: checked against the memory that is free before either is allocated
    const int    ring_rows  = std::max(params.ring_capacity, block_);
    const size_t ring_bytes = (size_t) ring_rows * draft_->capture_layers().size() * draft_->info().n_embd * sizeof(float);
    const size_t kv_bytes   = kv_cache::n_bytes_for(draft_->info(), n_slots_, GGML_TYPE_F32, GGML_TYPE_F32);
    const size_t have       = target.devices().free_memory(target.info().n_layer - 1);
    if (ring_bytes + kv_bytes > have) {
        throw context_overflow_error(format("the draft's context cache (window %d: %.1f MiB) and feature ring (%d rows: "
                                            "%.1f MiB) need more than the %.1f MiB that are free; lower draft_window "
                                            "or n_ubatch", window_, kv_bytes / 1048576.0, ring_rows,
                                            ring_bytes / 1048576.0, have / 1048576.0),
                                     0, n_ctx);
    }
    ring_ = std::make_unique<feature_ring>(target.devices(), target.info().n_layer - 1,
                                           (int) draft_->capture_layers().size(), draft_->info().n_embd,
                                           ring_rows);
    // f32 draft cache: the drafter's proposals are decided by argmax over small margins
    kv_ = std::make_unique<kv_cache>(draft_->info(), target.devices(), n_slots_, GGML_TYPE_F32, GGML_TYPE_F32,
                                     target.info().n_layer - 1);
    arena_.sched_for(draft_->max_graph_nodes());  // every graph it builds has at most this many nodes
}

draft_session::~draft_session() = default;

std::vector<int> draft_session::append_row_counts() { return {APPEND_ROWS_SMALL, APPEND_ROWS_LARGE}; }

int draft_session::window_step() { return KV_WINDOW_STEP; }

size_t draft_session::measure(int n_rows, int n_block, int n_kv) {
    if (n_rows != 0 && n_rows != APPEND_ROWS_SMALL && n_rows != APPEND_ROWS_LARGE) {
        throw std::invalid_argument(format("measure: n_rows = %d, expected 0, %d or %d", n_rows, APPEND_ROWS_SMALL,
                                           APPEND_ROWS_LARGE));
    }
    if (n_block < 0 || n_block > block_ || (n_block > 0 && (n_kv < n_block || n_kv > n_slots_))) {
        throw std::invalid_argument(format("measure: n_block = %d, n_kv = %d; expected n_block in [0, %d] and n_kv "
                                           "in [n_block, %d]", n_block, n_kv, block_, n_slots_));
    }
    graph g(arena_);
    build(g, n_rows, n_block, n_block > 0 ? n_kv : 0);
    return g.cache.measure();
}

void draft_session::build(graph & g, int n_rows, int n_block, int n_kv) {
    draft_inputs & in = g.in;
    ggml_context * ctx = g.cache.begin(draft_->max_graph_nodes());
    ggml_cgraph *  gf  = g.cache.graph();
    in                 = draft_inputs{};
    in.n_ctx_rows      = n_rows;
    in.n_block         = n_block;
    in.n_kv            = n_kv;
    g.ring_rows        = nullptr;
    if (n_rows > 0) {
        // the context features come straight from the ring, on the device
        g.ring_rows  = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_rows);
        in.ctx_feats = ggml_get_rows(ctx, ring_->rows(), g.ring_rows);  // [n_ext*E, n_rows]
        in.ctx_pos   = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_rows);
        in.ctx_slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_rows);
        for (ggml_tensor * t : {g.ring_rows, in.ctx_pos, in.ctx_slots}) {
            ggml_set_input(t);
        }
    }
    if (n_block > 0) {
        in.tokens  = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_block);
        in.pos     = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_block);
        in.slots   = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_block);
        in.kq_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_block);
        for (ggml_tensor * t : {in.tokens, in.pos, in.slots, in.kq_mask}) {
            ggml_set_input(t);
        }
        if (draft_->swa_window() > 0) {
            in.kq_mask_swa = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_block);
            ggml_set_input(in.kq_mask_swa);
        }
    }
    state_tensors st;
    kv_->fill(st, draft_->info().n_layer);
    ggml_tensor * hidden = draft_->build(ctx, gf, in, st);  // [E, n_block-1]
    g.top_ids = g.top_logprobs = nullptr;
    if (hidden) {
        const target_model & target = draft_->target();
        const bool           dflash2 = draft_->dflash2().present();
        const head_outputs   head   = build_top_k_readout(ctx, gf, target.output_head(), hidden, target.head_on_host(),
                                                          readout_k(), with_logprobs_ || dflash2);
        g.top_ids      = head.top_ids;
        g.top_logprobs = head.top_logprobs;
        g.lattice      = nullptr;
        if (dflash2) {
            g.lattice = build_dflash2_lattice(ctx, draft_->selector(), hidden, head.top_ids,
                                              ggml_view_1d(ctx, in.tokens, 1, 0));  // the anchor
            ggml_build_forward_expand(gf, g.lattice);
        }
    }
    g.key_rows  = n_rows;
    g.key_block = n_block;
    g.key_kv    = n_kv;
}

draft_session::call draft_session::shape(int m, int n_rows, int n_block, int32_t anchor, int start) const {
    call c;
    c.m       = m;
    c.n_rows  = n_rows;
    c.n_block = n_block;
    c.anchor  = anchor;
    c.start   = start;
    // padding rows (beyond m) sit at the positions right after the appended ones (the block's, when drafting)
    c.pad_from = n_block > 0 ? start : (m > 0 ? queued_pos_[m - 1] + 1 : 0);
    // slots are position % n_slots: while nothing has wrapped, only the first `end` slots are in use
    c.n_kv = n_block > 0 ? std::min(n_slots_, (int) GGML_PAD(start + n_block, KV_WINDOW_STEP)) : 0;
    return c;
}

void draft_session::set_inputs(const call & c, const call_inputs & in) {
    if (c.n_rows > 0) {
        set_context_rows(in, c.m, c.n_rows, c.pad_from);
    }
    if (c.m > 0) {
        // rows are appended in position order, through the skipped stretches between them; a gap would leave
        // missing rows below n_valid
        const bool all = c.m == (int) queued_pos_.size();
        n_valid_ = queued_pos_[0] <= n_valid_ ? (all ? queued_end_ : queued_pos_[c.m])
                                              : std::min(n_valid_, queued_pos_[0]);
    }
    if (c.n_block > 0) {
        set_block(in, c.n_block, c.n_kv, c.anchor, c.start);
    }
}

void draft_session::after_compute(const call & c) {
    // the block's slots and the padding rows hold transient rows: they become context only once appended (every
    // real row sits before pad_from; positions after it may be skipped ones, below n_valid)
    for (int i = 0; i < std::min(std::max(c.n_rows - c.m, c.n_block), block_); ++i) {
        const int s = slot(c.pad_from + i);
        if (slot_pos_[s] >= c.pad_from) {
            slot_pos_[s] = -1;
        }
    }
    queued_rows_.erase(queued_rows_.begin(), queued_rows_.begin() + c.m);
    queued_pos_.erase(queued_pos_.begin(), queued_pos_.begin() + c.m);
}

void draft_session::run(int m, int n_rows, int n_block, int32_t anchor, int start) {
    const call c = shape(m, n_rows, n_block, anchor, start);
    graph &    g = n_block > 0 ? draft_graph_ : n_rows <= APPEND_ROWS_SMALL ? append_small_ : append_large_;
    if (!(g.cache.ready() && g.key_rows == n_rows && g.key_block == n_block && g.key_kv == c.n_kv)) {
        build(g, n_rows, n_block, c.n_kv);
    }
    g.cache.allocate("the draft graph");
    set_inputs(c, {g.ring_rows, g.in.ctx_pos, g.in.ctx_slots, g.in.tokens, g.in.pos, g.in.slots, g.in.kq_mask,
                   g.in.kq_mask_swa});
    g.cache.compute("the draft graph");
    if (own_pool_) {
        // its workers would poll for the next graph while the target's pool computes: the two spin against
        // each other on the same cores (a round took ~20 ms instead of ~0.5 ms on a tiny pair)
        compute_->pause();
    }
    after_compute(c);
    if (n_block > 0) {
        read_proposals({g.top_ids, g.top_logprobs, g.lattice}, n_block);
    }
}

void draft_session::set_context_rows(const call_inputs & in, int m, int n_rows, int pad_from) {
    // rows beyond m are padding: they read any ring row and land in the slots of the block positions right
    // after (several on one slot: any of them wins), which are never read as context before real rows (or
    // this round's block) overwrite them, and which hold no context of the window
    std::vector<int32_t> r(n_rows), p(n_rows);
    std::vector<int64_t> s(n_rows);
    for (int i = 0; i < n_rows; ++i) {
        p[i] = i < m ? queued_pos_[i] : pad_from + (i - m) % block_;
        r[i] = i < m ? queued_rows_[i] : ring_->slot(p[i]);
        s[i] = slot(p[i]);
        slot_pos_[s[i]] = p[i];
    }
    ggml_backend_tensor_set(in.ring_rows, r.data(), 0, sizeof(int32_t) * n_rows);
    ggml_backend_tensor_set(in.ctx_pos, p.data(), sizeof(int32_t) * in.ctx_first, sizeof(int32_t) * n_rows);
    ggml_backend_tensor_set(in.ctx_slots, s.data(), 0, sizeof(int64_t) * n_rows);
}

void draft_session::set_block(const call_inputs & in, int n_block, int n_kv, int32_t anchor, int start) {
    std::vector<int32_t> toks(n_block, draft_->mask_token()), pos(n_block);
    std::vector<int64_t> slots(n_block);
    toks[0] = anchor;
    for (int i = 0; i < n_block; ++i) {
        pos[i]   = start + i;
        slots[i] = slot(start + i);
        slot_pos_[slots[i]] = start + i;
    }
    std::vector<ggml_fp16_t> mask, mask_swa;
    fill_block_mask(mask, n_block, n_kv, start, false);
    if (in.kq_mask_swa) {
        fill_block_mask(mask_swa, n_block, n_kv, start, true);
        ggml_backend_tensor_set(in.kq_mask_swa, mask_swa.data(), 0, sizeof(ggml_fp16_t) * mask_swa.size());
    }
    ggml_backend_tensor_set(in.tokens, toks.data(), sizeof(int32_t) * in.first, sizeof(int32_t) * n_block);
    ggml_backend_tensor_set(in.pos, pos.data(), sizeof(int32_t) * in.first, sizeof(int32_t) * n_block);
    ggml_backend_tensor_set(in.slots, slots.data(), 0, sizeof(int64_t) * n_block);
    ggml_backend_tensor_set(in.kq_mask, mask.data(), 0, sizeof(ggml_fp16_t) * mask.size());
}

void draft_session::fill_block_mask(std::vector<ggml_fp16_t> & mask, int n_block, int n_kv, int start,
                                    bool swa) const {
    // block row i (position start + i) sees the context window [start - window, start) and, non-causally, the
    // whole block; in sliding-window layers the positions p with start + i - swa_window < p, up to itself
    // (causal, z-lab's default) or to start + i + swa_window (not)
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    mask.assign((size_t) n_kv * n_block, ninf);
    const int w = draft_->swa_window();
    for (int i = 0; i < n_block; ++i) {
        const int q  = start + i;
        int       lo = std::max(0, start - window_);
        int       hi = draft_->causal() ? q + 1 : start + n_block;
        if (swa) {
            lo = std::max(lo, q - w + 1);
            hi = draft_->swa_causal() ? q + 1 : std::min(start + n_block, q + w);
        }
        ggml_fp16_t * row = mask.data() + (size_t) i * n_kv;
        for (int j = 0; j < n_kv; ++j) {
            if (slot_pos_[j] >= lo && slot_pos_[j] < hi) {
                row[j] = zero;
            }
        }
    }
}

int draft_session::readout_k() const {
    return draft_->dflash2().present() ? (int) draft_->dflash2().top_k : top_k_;
}

void draft_session::read_proposals(const call_outputs & out, int n_block) {
    if (out.lattice) {
        read_selected(out, n_block);
        return;
    }
    proposals_.n_positions = n_block - 1;
    proposals_.top_k       = top_k_;
    proposals_.ids.resize((size_t) (n_block - 1) * top_k_);
    proposals_.logprobs.resize(proposals_.ids.size());
    const size_t at = (size_t) out.first * top_k_;
    ggml_backend_tensor_get(out.top_ids, proposals_.ids.data(), sizeof(int32_t) * at,
                            sizeof(int32_t) * proposals_.ids.size());
    if (out.top_logprobs) {
        ggml_backend_tensor_get(out.top_logprobs, proposals_.logprobs.data(), sizeof(float) * at,
                                sizeof(float) * proposals_.logprobs.size());
    } else {
        std::fill(proposals_.logprobs.begin(), proposals_.logprobs.end(), 0.0f);
    }
    sort_top_k(proposals_.ids.data(), proposals_.logprobs.data(), n_block - 1, top_k_);
}

void draft_session::read_selected(const call_outputs & out, int n_block) {
    const int64_t P = n_block - 1, k = readout_k();
    std::vector<int32_t> cand((size_t) (P * k));
    std::vector<float>   unary(cand.size()), lattice((size_t) (P * k * k));
    const size_t         at = (size_t) (out.first * k);
    ggml_backend_tensor_get(out.top_ids, cand.data(), sizeof(int32_t) * at, sizeof(int32_t) * cand.size());
    ggml_backend_tensor_get(out.top_logprobs, unary.data(), sizeof(float) * at, sizeof(float) * unary.size());
    ggml_backend_tensor_get(out.lattice, lattice.data(), sizeof(float) * at * k, sizeof(float) * lattice.size());
    dflash2_ranking ranked;
    rank_dflash2_candidates(cand.data(), unary.data(), lattice.data(), P, k, ranked);
    if (dflash2_tree_ != selector_tree::per_node) {
        unconditional(ranked, cand.data(), unary.data(), P, k);
        return;
    }
    // the best top_k_ of each position's k (the path's token first), and of each candidate's children
    const int out_k        = (int) std::min<int64_t>(top_k_, k);
    proposals_.n_positions = (int) P;
    proposals_.top_k       = out_k;
    proposals_.all_k       = (int) k;
    proposals_.all_ids     = ranked.ids;
    proposals_.ids.resize((size_t) (P * out_k));
    proposals_.logprobs.resize(proposals_.ids.size());
    proposals_.child_rank.resize((size_t) (P * k * out_k));
    proposals_.child_logprob.resize(proposals_.child_rank.size());
    for (int64_t t = 0; t < P; ++t) {
        std::copy_n(ranked.ids.data() + t * k, out_k, proposals_.ids.data() + t * out_k);
        std::copy_n(ranked.logprobs.data() + t * k, out_k, proposals_.logprobs.data() + t * out_k);
        for (int64_t i = 0; i < k; ++i) {
            std::copy_n(ranked.child_rank.data() + (t * k + i) * k, out_k,
                        proposals_.child_rank.data() + (t * k + i) * out_k);
            std::copy_n(ranked.child_logprob.data() + (t * k + i) * k, out_k,
                        proposals_.child_logprob.data() + (t * k + i) * out_k);
        }
    }
}

void draft_session::unconditional(const dflash2_ranking & ranked, const int32_t * cand, const float * unary, int64_t P,
                                  int64_t k) {
    const int out_k        = (int) std::min<int64_t>(top_k_, k);
    proposals_             = draft_proposals{};
    proposals_.n_positions = (int) P;
    proposals_.top_k       = out_k;
    proposals_.ids.resize((size_t) (P * out_k));
    proposals_.logprobs.resize(proposals_.ids.size());
    std::vector<int32_t> ids(cand, cand + P * k);
    std::vector<float>   lps(unary, unary + P * k);
    sort_top_k(ids.data(), lps.data(), P, (int) k);  // the drafter's own order, best first
    for (int64_t t = 0; t < P; ++t) {
        for (int r = 0; r < out_k; ++r) {
            const bool path   = dflash2_tree_ == selector_tree::path;
            // unary: the drafter's order, but the selector's path first (a chain is the selector's pick)
            const int32_t tok = path ? ranked.ids[t * k + r] : ids[t * k + r];
            proposals_.ids[t * out_k + r]      = tok;
            proposals_.logprobs[t * out_k + r] = path ? ranked.logprobs[t * k + r] : lps[t * k + r];
        }
        if (dflash2_tree_ == selector_tree::unary) {
            // move the path's token to rank 0 (the order of the others kept)
            int32_t * row = proposals_.ids.data() + t * out_k;
            float *   lp  = proposals_.logprobs.data() + t * out_k;
            const int32_t pick = ranked.ids[t * k];
            int at = -1;
            for (int r = 0; r < out_k; ++r) {
                at = row[r] == pick ? r : at;
            }
            if (at < 0) {  // beyond the kept ranks: it replaces the last
                at = out_k - 1;
                row[at] = pick;
                lp[at]  = unary[t * k + std::distance(cand + t * k, std::find(cand + t * k, cand + (t + 1) * k, pick))];
            }
            std::rotate(row, row + at, row + at + 1);
            std::rotate(lp, lp + at, lp + at + 1);
        }
    }
}

void draft_session::queue(const int32_t * ring_rows, const int32_t * positions, int m) {
    for (int i = 0; i < m; ++i) {
        if (ring_rows[i] < 0 || ring_rows[i] >= ring_->capacity()) {
            throw std::out_of_range(format("draft: ring row %d is outside [0, %d)", ring_rows[i], ring_->capacity()));
        }
        if (positions[i] < 0 || positions[i] > MAX_POSITION || (!queued_pos_.empty() && positions[i] != queued_end_)) {
            throw std::invalid_argument(format("draft: context position %d does not follow the queued ones",
                                               positions[i]));
        }
        queued_rows_.push_back(ring_rows[i]);
        queued_pos_.push_back(positions[i]);
        queued_end_ = positions[i] + 1;
    }
}

void draft_session::queue_positions(int first, int m) {
    std::vector<int32_t> rows(m), pos(m);
    for (int i = 0; i < m; ++i) {
        pos[i]  = first + i;
        rows[i] = ring_->slot(first + i);
    }
    queue(rows.data(), pos.data(), m);
}

void draft_session::skip(int first, int m) {
    if (m <= 0) {
        return;
    }
    if (first != n_valid() || (!queued_pos_.empty() && first != queued_end_) || first > MAX_POSITION - m) {
        throw std::invalid_argument(format("draft: skipped positions [%d, %d) do not follow the context rows, "
                                           "which end at %d", first, first + m, n_valid()));
    }
    for (int p = std::max(first, first + m - n_slots_); p < first + m; ++p) {
        slot_pos_[slot(p)] = -1;  // what a slot held before is outside every window that reaches p
    }
    if (!skipped_.empty() && skipped_.back().second == first) {
        skipped_.back().second = first + m;
    } else {
        skipped_.emplace_back(first, first + m);
    }
    // older stretches no truncation's window check can reach
    while (skipped_.size() > 1 && skipped_.front().second < first - 2 * n_slots_) {
        skipped_.erase(skipped_.begin());
    }
    // behind queued rows, the stretch waits in the queue's gaps (appending them would cost a graph, and rows a
    // later prompt does not reuse are never appended)
    (queued_pos_.empty() ? n_valid_ : queued_end_) = first + m;
}

bool draft_session::skipped(int position) const {
    for (const auto & [from, to] : skipped_) {
        if (position >= from && position < to) {
            return true;
        }
    }
    return false;
}

void draft_session::flush() {
    while (!queued_rows_.empty()) {
        const int n = append_rows((int) queued_rows_.size());
        run(appendable(n), n, 0, 0, 0);
    }
}

int draft_session::appendable(int limit) const {
    // one graph's rows, padding included (up to a block past the last), must land in distinct cache slots: with
    // skipped stretches between queued rows, or a window shorter than a graph's rows, two of them could lie a
    // whole n_slots apart, and one set_rows would write both into one slot at once (the CPU's threads take
    // contiguous row ranges, a GPU's blocks any order): either row, or a mix
    int m = 1;
    while (m < std::min<int>(limit, (int) queued_pos_.size()) && queued_pos_[m] - queued_pos_[0] < window_) {
        ++m;
    }
    return m;
}

int draft_session::n_valid() const {
    // queued rows (and skipped stretches between and after them) count when they continue the appended ones
    // (what flush() would make of them)
    return !queued_pos_.empty() && queued_pos_.front() <= n_valid_ ? queued_end_ : n_valid_;
}

void draft_session::protect(int first, int n) {
    if (ring_->overwrites(first, n, queued_rows_)) {
        flush();
    }
}

const draft_proposals & draft_session::draft(int32_t anchor, int start, int n_block) {
    const call c = prepare_draft(anchor, start, n_block);
    run(c.m, c.n_rows, c.n_block, anchor, start);
    return proposals_;
}

draft_session::call draft_session::prepare_draft(int32_t anchor, int start, int n_block) {
    n_block = n_block > 0 ? n_block : block_;
    if (n_block < 2 || n_block > block_ || start < 0 || start > MAX_POSITION - n_block) {
        throw std::invalid_argument(format("draft: a block of %d (2..%d) at position %d", n_block, block_, start));
    }
    if (anchor < 0 || anchor >= draft_->target().info().n_vocab) {
        throw std::out_of_range(format("draft: anchor token %d is outside the vocabulary [0, %lld)", anchor,
                                       (long long) draft_->target().info().n_vocab));
    }
    // more than this graph appends, or rows before the block's window (whose slots its block may share): the
    // oldest first, alone
    while (!queued_rows_.empty() && ((int) queued_rows_.size() > block_ || queued_pos_.front() < start - window_)) {
        int k = std::max((int) queued_rows_.size() - block_, 1);
        while (k < (int) queued_rows_.size() && queued_pos_[k] < start - window_) {
            ++k;
        }
        const int n = append_rows(k);
        run(appendable(std::min(n, k)), n, 0, 0, 0);
    }
    if (!queued_pos_.empty() && queued_end_ > start) {
        throw std::invalid_argument(format("draft: queued context reaches position %d, the block starts at %d",
                                           queued_end_ - 1, start));
    }
    return shape((int) queued_rows_.size(), block_, n_block, anchor, start);
}

void draft_session::truncate(int n_past) {
    while (!queued_pos_.empty() && queued_pos_.back() >= n_past) {
        queued_pos_.pop_back();
        queued_rows_.pop_back();
    }
    queued_end_ = std::min(queued_end_, n_past);
    while (!skipped_.empty() && skipped_.back().first >= n_past) {
        skipped_.pop_back();
    }
    if (!skipped_.empty()) {
        skipped_.back().second = std::min(skipped_.back().second, n_past);
    }
    if (n_past >= n_valid_) {
        return;  // the queue (rows below n_past) stays for a later append
    }
    for (int32_t & p : slot_pos_) {
        if (p >= n_past) {
            p = -1;
        }
    }
    n_valid_ = n_past;
    // the window before n_past must be whole but for skipped positions; later positions may have overwritten its
    // slots
    for (int p = std::max(0, n_past - window_); p < n_past; ++p) {
        if (slot_pos_[slot(p)] != p && !skipped(p)) {
            n_valid_ = 0;
            std::fill(slot_pos_.begin(), slot_pos_.end(), -1);
            skipped_.clear();
            break;
        }
    }
}

}  // namespace pdf
