#include "state/draft_session.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>

namespace pdf {

static constexpr int KV_WINDOW_STEP = 256;

draft_session::draft_session(std::shared_ptr<const dflash_draft> draft, uint32_t n_ctx, const draft_params & params)
    : draft_(std::move(draft)) {
    block_ = params.block > 0 ? params.block : draft_->block_size();
    if (block_ < 2 || block_ > draft_->block_size()) {
        throw std::invalid_argument(format("block_size = %d must be in [2, %d] (the draft's trained block size)",
                                           block_, draft_->block_size()));
    }
    if (params.window <= 0 || params.ring_capacity <= 0) {
        throw std::invalid_argument(format("draft window (%d) and feature ring capacity (%d) must be positive",
                                           params.window, params.ring_capacity));
    }
    window_  = (int) std::min<int64_t>(params.window, n_ctx);
    n_slots_ = window_ + block_;
    slot_pos_.assign(n_slots_, -1);
    const target_model & target = draft_->target();
    ring_ = std::make_unique<feature_ring>(target.devices(), target.info().n_layer - 1,
                                           (int) draft_->capture_layers().size(), draft_->info().n_embd,
                                           std::max(params.ring_capacity, block_));
    // f32 draft cache: the drafter's proposals are decided by argmax over small margins
    kv_    = std::make_unique<kv_cache>(draft_->info(), target.devices(), n_slots_, GGML_TYPE_F32, GGML_TYPE_F32);
    sched_ = target.devices().new_sched(draft_->max_graph_nodes());
}

draft_session::~draft_session() {
    if (sched_) {
        ggml_backend_sched_free(sched_);
    }
    if (graph_ctx_) {
        ggml_free(graph_ctx_);
    }
}

void draft_session::run(const int32_t * positions, int m, int n_rows, int n_block, int32_t anchor, int start) {
    const int end  = n_block > 0 ? start + n_block : (m > 0 ? positions[m - 1] + 1 : 0);
    // slots are position % n_slots: while nothing has wrapped, only the first `end` slots are in use
    const int n_kv = std::min(n_slots_, (int) GGML_PAD(end, KV_WINDOW_STEP));
    if (!(graph_ctx_ && key_rows_ == n_rows && key_block_ == n_block && key_kv_ == n_kv)) {
        if (graph_ctx_) {
            ggml_free(graph_ctx_);
        }
        ggml_backend_sched_reset(sched_);
        const size_t n_nodes = draft_->max_graph_nodes();
        graph_buf_.resize(ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false));
        ggml_init_params params = {graph_buf_.size(), graph_buf_.data(), true};
        graph_ctx_ = ggml_init(params);
        gf_        = ggml_new_graph_custom(graph_ctx_, n_nodes, false);
        in_        = draft_inputs{};
        in_.n_ctx_rows = n_rows;
        in_.n_block    = n_block;
        in_.n_kv       = n_kv;
        ring_rows_     = nullptr;
        if (n_rows > 0) {
            // the context features come straight from the ring, on the device
            ring_rows_    = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I32, n_rows);
            in_.ctx_feats = ggml_get_rows(graph_ctx_, ring_->rows(), ring_rows_);  // [n_ext*E, n_rows]
            in_.ctx_pos   = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I32, n_rows);
            in_.ctx_slots = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I64, n_rows);
            for (ggml_tensor * t : {ring_rows_, in_.ctx_pos, in_.ctx_slots}) {
                ggml_set_input(t);
            }
        }
        if (n_block > 0) {
            in_.tokens  = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I32, n_block);
            in_.pos     = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I32, n_block);
            in_.slots   = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I64, n_block);
            in_.kq_mask = ggml_new_tensor_2d(graph_ctx_, GGML_TYPE_F16, n_kv, n_block);
            for (ggml_tensor * t : {in_.tokens, in_.pos, in_.slots, in_.kq_mask}) {
                ggml_set_input(t);
            }
        }
        out_ = draft_->build(graph_ctx_, gf_, in_, *kv_);
        if (out_) {
            ggml_set_output(out_);
            ggml_build_forward_expand(gf_, out_);
        }
        if (!ggml_backend_sched_alloc_graph(sched_, gf_)) {
            graph_ctx_ = nullptr;
            throw backend_error("could not allocate the draft graph");
        }
        key_rows_  = n_rows;
        key_block_ = n_block;
        key_kv_    = n_kv;
    }

    if (n_rows > 0) {
        // rows beyond m are padding: they read any ring row and land in slots of this round's block, which
        // the block overwrites right after (they are never read as context)
        std::vector<int32_t> r(n_rows), p(n_rows);
        std::vector<int64_t> s(n_rows);
        for (int i = 0; i < n_rows; ++i) {
            p[i] = i < m ? positions[i] : start + (i - m);
            r[i] = ring_->slot(p[i]);
            s[i] = slot(p[i]);
            slot_pos_[s[i]] = p[i];
        }
        ggml_backend_tensor_set(ring_rows_, r.data(), 0, sizeof(int32_t) * n_rows);
        ggml_backend_tensor_set(in_.ctx_pos, p.data(), 0, sizeof(int32_t) * n_rows);
        ggml_backend_tensor_set(in_.ctx_slots, s.data(), 0, sizeof(int64_t) * n_rows);
    }
    if (n_block > 0) {
        std::vector<int32_t> toks(n_block, draft_->mask_token()), pos(n_block);
        std::vector<int64_t> slots(n_block);
        toks[0] = anchor;
        for (int i = 0; i < n_block; ++i) {
            pos[i]   = start + i;
            slots[i] = slot(start + i);
            slot_pos_[slots[i]] = start + i;
        }
        // block row i sees the context window [start - window, start) and, non-causally, the whole block
        const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
        const int lo = std::max(0, start - window_);
        std::vector<ggml_fp16_t> mask((size_t) n_kv * n_block, ninf);
        for (int i = 0; i < n_block; ++i) {
            const int hi = draft_->causal() ? start + i + 1 : start + n_block;
            ggml_fp16_t * row = mask.data() + (size_t) i * n_kv;
            for (int j = 0; j < n_kv; ++j) {
                if (slot_pos_[j] >= lo && slot_pos_[j] < hi) {
                    row[j] = zero;
                }
            }
        }
        ggml_backend_tensor_set(in_.tokens, toks.data(), 0, sizeof(int32_t) * n_block);
        ggml_backend_tensor_set(in_.pos, pos.data(), 0, sizeof(int32_t) * n_block);
        ggml_backend_tensor_set(in_.slots, slots.data(), 0, sizeof(int64_t) * n_block);
        ggml_backend_tensor_set(in_.kq_mask, mask.data(), 0, sizeof(ggml_fp16_t) * mask.size());
    }
    if (ggml_backend_sched_graph_compute(sched_, gf_) != GGML_STATUS_SUCCESS) {
        throw backend_error("draft graph computation failed");
    }
    if (m > 0) {
        // rows are appended in position order; a gap would leave missing rows below n_valid
        n_valid_ = positions[0] <= n_valid_ ? positions[m - 1] + 1 : std::min(n_valid_, positions[0]);
    }
    // the block's slots and the padding rows (positions start.. too) hold transient rows: they become
    // context only once appended from the ring
    for (int i = 0; i < std::max(n_rows - m, n_block); ++i) {
        if (slot_pos_[slot(start + i)] >= n_valid_) {
            slot_pos_[slot(start + i)] = -1;
        }
    }
    if (n_block > 0) {
        proposals_.resize(n_block - 1);
        ggml_backend_tensor_get(out_, proposals_.data(), 0, sizeof(int32_t) * proposals_.size());
    }
}

void draft_session::append(const int32_t * positions, int m) {
    for (int i = 0; i < m; i += block_) {
        const int n = std::min(block_, m - i);
        run(positions + i, n, n, 0, 0, 0);
    }
}

const std::vector<int32_t> & draft_session::draft(const int32_t * positions, int m, int32_t anchor, int start,
                                                  int n_block) {
    n_block = n_block > 0 ? n_block : block_;
    if (m > block_ || n_block < 2 || n_block > block_) {
        throw std::invalid_argument(format("draft: %d new context rows (at most %d) and a block of %d (2..%d)", m,
                                           block_, n_block, block_));
    }
    run(positions, m, block_, n_block, anchor, start);
    return proposals_;
}

void draft_session::truncate(int n_past) {
    if (n_past >= n_valid_) {
        return;
    }
    for (int32_t & p : slot_pos_) {
        if (p >= n_past) {
            p = -1;
        }
    }
    n_valid_ = n_past;
    // the window before n_past must be whole; later positions may have overwritten its slots
    for (int p = std::max(0, n_past - window_); p < n_past; ++p) {
        if (slot_pos_[slot(p)] != p) {
            n_valid_ = 0;
            std::fill(slot_pos_.begin(), slot_pos_.end(), -1);
            break;
        }
    }
}

}  // namespace pdf
