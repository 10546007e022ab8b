#include "state/session.h"
#include "core/error.h"
#include "core/log.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace pdf {

// The attended KV window grows in steps of this many slots: the graph is rebuilt once per step. Masked slots
// still cost time in the CPU's small-window attention (matmul + softmax + the V transpose run over the whole
// window), so the step is small: 64 instead of 256 took ~5% off a tiny 4-layer Qwen3's decode step over 128
// tokens (perf samples per token), while its rebuilds (~0.5 ms each there, a fifth of one step) cost < 0.5%.
// Which attention kernel runs is still decided on 256-slot windows (models/blocks.cpp).
static constexpr int KV_WINDOW_STEP = 64;

session::session(std::shared_ptr<const target_model> model, const session_params & params) : model_(std::move(model)) {
    const model_info & info = model_->info();
    if (params.n_ctx == 0 || params.n_ubatch == 0) {
        throw std::invalid_argument(format("n_ctx (%u) and n_ubatch (%u) must be positive", params.n_ctx,
                                           params.n_ubatch));
    }
    n_ubatch_ = params.n_ubatch;
    if (params.n_ctx > info.n_ctx_train && info.n_ctx_train > 0) {
        PDF_LOG_WARN("n_ctx = %u exceeds the model's training context %u (%s); quality may degrade", params.n_ctx,
                     info.n_ctx_train, info.path.c_str());
    }
    kv_cache::check_types(info, params.type_k, params.type_v);
    const size_t kv_need = kv_cache::n_bytes_for(info, params.n_ctx, params.type_k, params.type_v);
    const size_t rs_need = recurrent_state::n_bytes_for(info, params.n_rollback);
    const size_t have    = model_->devices().free_memory(info.n_layer - 1);
    PDF_LOG_INFO("KV cache: n_ctx = %u, K %s, V %s: %.2f MiB; recurrent state (rollback over %u tokens): %.2f MiB",
                 params.n_ctx, ggml_type_name(params.type_k), ggml_type_name(params.type_v), kv_need / 1048576.0,
                 params.n_rollback, rs_need / 1048576.0);
    if (kv_need + rs_need > have) {
        throw context_overflow_error(format("KV cache for n_ctx = %u (%.1f MiB) and recurrent state (%.1f MiB) need "
                                            "more than the %.1f MiB that are free; lower n_ctx or use a quantized "
                                            "kv_type", params.n_ctx, kv_need / 1048576.0, rs_need / 1048576.0,
                                            have / 1048576.0),
                                     0, params.n_ctx);
    }
    kv_ = std::make_unique<kv_cache>(info, model_->devices(), params.n_ctx, params.type_k, params.type_v);
    if (!info.recurrent_layers.empty()) {
        rs_ = std::make_unique<recurrent_state>(*model_, params.n_rollback);
    }
    sched_ = model_->devices().new_sched(model_->max_graph_nodes());
    if (!sched_) {
        throw backend_error("could not create the backend scheduler");
    }
}

session::~session() {
    if (sched_) {
        ggml_backend_sched_free(sched_);
    }
    if (graph_ctx_) {
        ggml_free(graph_ctx_);
    }
}

void session::prepare_graph(const graph_key & key) {
    if (have_graph_ && key == key_) {
        return;
    }
    if (graph_ctx_) {
        ggml_free(graph_ctx_);
        graph_ctx_ = nullptr;
    }
    ggml_backend_sched_reset(sched_);
    const size_t n_nodes = model_->max_graph_nodes();
    graph_buf_.resize(ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false));
    ggml_init_params params = {graph_buf_.size(), graph_buf_.data(), true};
    graph_ctx_              = ggml_init(params);
    gf_                     = ggml_new_graph_custom(graph_ctx_, n_nodes, false);

    in_                = eval_inputs{};
    in_.n_tokens       = key.n_tokens;
    in_.n_kv           = key.n_kv;
    in_.all_logits     = key.all_logits;
    in_.capture_layers = key.capture;
    in_.tokens         = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I32, key.n_tokens);
    in_.positions = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I32,
                                       (int64_t) key.n_tokens * model_->info().n_pos_per_token);
    in_.kv_slots       = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I64, key.n_tokens);
    in_.kq_mask        = ggml_new_tensor_2d(graph_ctx_, GGML_TYPE_F16, key.n_kv, key.n_tokens);
    for (ggml_tensor * t : {in_.tokens, in_.positions, in_.kv_slots, in_.kq_mask}) {
        ggml_set_input(t);
    }
    if (rs_) {
        const int64_t d_conv = model_->info().recurrent_layers[0].d_conv;
        in_.ssm_row          = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I32, 1);
        in_.conv_rows        = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I32, d_conv - 1);
        in_.ssm_snapshot_rows = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I64, rs_->n_snapshots(key.n_tokens));
        ggml_set_input(in_.ssm_row);
        ggml_set_input(in_.conv_rows);
        ggml_set_input(in_.ssm_snapshot_rows);
    }

    out_ = model_->build_eval(graph_ctx_, gf_, in_, *kv_, rs_.get());
    ggml_set_output(out_.logits);
    ggml_set_output(out_.argmax);
    ggml_build_forward_expand(gf_, out_.argmax);
    ring_slots_ = nullptr;
    if (key.ring && !out_.captured.empty()) {
        ring_slots_ = ggml_new_tensor_1d(graph_ctx_, GGML_TYPE_I64, key.n_tokens);
        ggml_set_input(ring_slots_);
    }
    for (size_t c = 0; c < out_.captured.size(); ++c) {
        ggml_tensor * t = out_.captured[c];
        GGML_ASSERT(t != nullptr);
        if (ring_slots_) {
            ggml_build_forward_expand(gf_, ggml_set_rows(graph_ctx_, key.ring->layer_view(graph_ctx_, (int) c), t,
                                                         ring_slots_));
        } else {
            ggml_set_output(t);
            ggml_build_forward_expand(gf_, t);
        }
    }
    if (!ggml_backend_sched_alloc_graph(sched_, gf_)) {
        have_graph_ = false;
        throw backend_error(format("could not allocate the compute graph for %d tokens over %d cache slots",
                                   key.n_tokens, key.n_kv));
    }
    key_        = key;
    have_graph_ = true;
}

void session::eval(const int32_t * tokens, const int32_t * positions, int n, const uint8_t * batch_mask,
                   logits_mode mode, const std::vector<int> & capture_layers, feature_ring * ring) {
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
    if (ring && (ring->row_width() != (int64_t) capture_layers.size() * info.n_embd || n > ring->capacity())) {
        throw std::invalid_argument(format("eval: %d tokens x %zu capture layers do not fit the feature ring "
                                           "(%d rows of %lld floats)", n, capture_layers.size(), ring->capacity(),
                                           (long long) ring->row_width()));
    }

    if (rs_ && !pending_.empty()) {
        rs_->commit((int) pending_.size(), 0);  // the last eval was never committed: start from before it
    }

    graph_key key;
    key.n_tokens   = n;
    key.n_kv       = (int) std::min<uint32_t>(kv_->n_ctx(), GGML_PAD(n_past_ + n, KV_WINDOW_STEP));
    key.all_logits = mode == LOGITS_ALL || mode == ARGMAX_ALL;
    key.capture    = capture_layers;
    key.ring       = capture_layers.empty() ? nullptr : ring;
    prepare_graph(key);

    // inputs
    slots_host_.resize(n);
    const int            n_pos = info.n_pos_per_token;
    std::vector<int32_t> pos_host((size_t) n * n_pos, 0);
    for (int i = 0; i < n; ++i) {
        slots_host_[i]   = n_past_ + i;
        const int32_t p  = positions ? positions[i] : n_past_ + i;
        // M-RoPE for text: the first three sections all take the token position, the fourth stays 0
        for (int j = 0; j < std::min(n_pos, 3); ++j) {
            pos_host[(size_t) j * n + i] = p;
        }
    }
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    mask_host_.assign((size_t) key.n_kv * n, ninf);
    for (int i = 0; i < n; ++i) {
        ggml_fp16_t * row = mask_host_.data() + (size_t) i * key.n_kv;
        std::fill(row, row + n_past_, zero);
        for (int j = 0; j < n; ++j) {
            const bool visible = batch_mask ? batch_mask[(size_t) i * n + j] != 0 : j <= i;
            if (visible) {
                row[n_past_ + j] = zero;
            }
        }
    }
    ggml_backend_tensor_set(in_.tokens, tokens, 0, sizeof(int32_t) * n);
    ggml_backend_tensor_set(in_.positions, pos_host.data(), 0, sizeof(int32_t) * pos_host.size());
    if (rs_) {
        std::vector<int32_t> conv_rows(in_.conv_rows->ne[0]);
        for (size_t j = 0; j < conv_rows.size(); ++j) {
            conv_rows[j] = rs_->conv_row() + (int32_t) j;
        }
        const int32_t ssm_row = rs_->ssm_row();
        ggml_backend_tensor_set(in_.ssm_row, &ssm_row, 0, sizeof(int32_t));
        ggml_backend_tensor_set(in_.conv_rows, conv_rows.data(), 0, sizeof(int32_t) * conv_rows.size());
        std::vector<int64_t> snapshot_rows(rs_->n_snapshots(n));
        for (size_t s = 0; s < snapshot_rows.size(); ++s) {
            snapshot_rows[s] = rs_->snapshot_row((int) s);
        }
        ggml_backend_tensor_set(in_.ssm_snapshot_rows, snapshot_rows.data(), 0,
                                sizeof(int64_t) * snapshot_rows.size());
    }
    ggml_backend_tensor_set(in_.kv_slots, slots_host_.data(), 0, sizeof(int64_t) * n);
    ggml_backend_tensor_set(in_.kq_mask, mask_host_.data(), 0, sizeof(ggml_fp16_t) * mask_host_.size());
    if (ring_slots_) {
        std::vector<int64_t> ring_rows(n);
        for (int i = 0; i < n; ++i) {
            ring_rows[i] = ring->slot(n_past_ + i);
        }
        ggml_backend_tensor_set(ring_slots_, ring_rows.data(), 0, sizeof(int64_t) * n);
    }

    if (ggml_backend_sched_graph_compute(sched_, gf_) != GGML_STATUS_SUCCESS) {
        throw backend_error("graph computation failed");
    }

    // outputs
    n_outputs_ = (int) out_.argmax->ne[0];
    argmax_.resize(n_outputs_);
    ggml_backend_tensor_get(out_.argmax, argmax_.data(), 0, sizeof(int32_t) * n_outputs_);
    if (mode == LOGITS_NONE || mode == ARGMAX_ALL) {
        logits_.clear();
    } else {
        logits_.resize((size_t) n_outputs_ * info.n_vocab);
        ggml_backend_tensor_get(out_.logits, logits_.data(), 0, sizeof(float) * logits_.size());
    }
    captured_.resize(ring_slots_ ? 0 : out_.captured.size());
    for (size_t c = 0; c < captured_.size(); ++c) {
        captured_[c].resize((size_t) n * info.n_embd);
        ggml_backend_tensor_get(out_.captured[c], captured_[c].data(), 0, sizeof(float) * captured_[c].size());
    }
    pending_.assign(tokens, tokens + n);
}

void session::commit(int n) {
    if (n < 0 || n > (int) pending_.size()) {
        throw std::out_of_range(format("commit: %d tokens, but the last eval had %zu", n, pending_.size()));
    }
    if (rs_) {
        rs_->commit((int) pending_.size(), n);
    }
    tokens_.insert(tokens_.end(), pending_.begin(), pending_.begin() + n);
    n_past_ += n;
    pending_.clear();
}

void session::truncate(int n_past) {
    if (n_past < 0 || n_past > n_past_) {
        throw std::out_of_range(format("truncate: %d is outside [0, %d]", n_past, n_past_));
    }
    if (rs_ && n_past == 0) {
        rs_->reset();  // always possible, also after an uncommitted eval longer than the snapshots reach
    } else if (rs_ && n_past != n_past_) {
        throw std::invalid_argument(format("truncate: a recurrent state cannot be cut back to %d tokens (only "
                                           "reset to 0, or rolled back by commit after an eval)", n_past));
    } else if (rs_ && !pending_.empty()) {
        rs_->commit((int) pending_.size(), 0);
    }
    n_past_ = n_past;
    tokens_.resize(n_past);
    pending_.clear();
}

}  // namespace pdf
