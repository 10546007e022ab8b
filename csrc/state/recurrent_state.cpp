#include "state/recurrent_state.h"
#include "core/error.h"

#include "ggml-alloc.h"

#include <stdexcept>
#include <vector>

namespace pdf {

size_t recurrent_state::n_bytes_for(const model_info & info, uint32_t n_rollback) {
    size_t n = 0;
    for (const recurrent_layer_desc & l : info.recurrent_layers) {
        n += sizeof(float) * (size_t) l.ssm_size * ((size_t) n_rollback + 1);
        n += sizeof(float) * (size_t) l.conv_channels * ((size_t) l.d_conv - 1 + n_rollback);
        n += sizeof(float) * ((size_t) l.ssm_size + (size_t) l.conv_channels * (l.d_conv - 1)) * N_CHECKPOINTS;
    }
    return n;
}

recurrent_state::recurrent_state(const model_info & info, const backends & devices, uint32_t n_rollback)
    : n_rollback_(n_rollback) {
    if (n_rollback == 0) {
        throw std::invalid_argument("n_rollback must be at least 1");
    }
    if (info.recurrent_layers.empty()) {
        throw std::invalid_argument("recurrent state for a model without recurrent layers");
    }
    conv_window_            = (int) info.recurrent_layers[0].d_conv - 1;
    ggml_init_params params = {ggml_tensor_overhead() * (4 * info.recurrent_layers.size() + 1), nullptr, true};
    ctx_                    = ggml_init(params);
    std::map<ggml_backend_buffer_type_t, std::vector<ggml_tensor *>> by_buft;
    for (const recurrent_layer_desc & l : info.recurrent_layers) {
        ggml_tensor * ssm  = ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, l.ssm_size, n_rollback + 1);
        ggml_tensor * conv = ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, l.conv_channels, l.d_conv - 1 + n_rollback);
        ggml_format_name(ssm, "ssm_states_l%d", l.il);
        ggml_format_name(conv, "conv_states_l%d", l.il);
        ggml_tensor * ssm_ckpt  = ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, l.ssm_size, N_CHECKPOINTS);
        ggml_tensor * conv_ckpt = ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, l.conv_channels, (l.d_conv - 1) * N_CHECKPOINTS);
        ggml_format_name(ssm_ckpt, "ssm_checkpoints_l%d", l.il);
        ggml_format_name(conv_ckpt, "conv_checkpoints_l%d", l.il);
        layers_[l.il]      = {ssm, conv};
        checkpoints_[l.il] = {ssm_ckpt, conv_ckpt};
        ggml_backend_buffer_type_t buft = devices.state_buft(l.il);
        for (ggml_tensor * t : {ssm, conv, ssm_ckpt, conv_ckpt}) {
            by_buft[buft].push_back(t);
        }
    }
    for (auto & kv : by_buft) {
        ggml_backend_buffer_t buf = alloc_tensors(kv.first, kv.second);
        if (!buf) {
            release();  // (a throwing constructor runs no destructor)
            throw backend_error(format("could not allocate the recurrent state (%.1f MiB in all) in %s",
                                       n_bytes_for(info, n_rollback) / 1048576.0, ggml_backend_buft_name(kv.first)));
        }
        buffers_.push_back(buf);
    }
    reset();
}

recurrent_state::~recurrent_state() { release(); }

void recurrent_state::release() {
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_free(b);
    }
    buffers_.clear();
    if (ctx_) {
        ggml_free(ctx_);
        ctx_ = nullptr;
    }
}

void recurrent_state::fill(state_tensors & st, int n_layer) const {
    st.ssm.assign(n_layer, nullptr);
    st.conv.assign(n_layer, nullptr);
    for (const auto & kv : layers_) {
        st.ssm[kv.first]  = kv.second.first;
        st.conv[kv.first] = kv.second.second;
    }
}

size_t recurrent_state::n_bytes() const {
    return memory().total();
}

device_bytes recurrent_state::memory() const {
    return bytes_by_device(buffers_);
}

void recurrent_state::reset() {
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_clear(b, 0);
    }
    ssm_row_ = 0;
    conv_rows_from(0);
}

// row `from` of `src` -> row `to` of `dst` (2-D F32 tensors of the same row width), through the host: a few
// MiB per prompt, so no graph is built for it
static void copy_row(ggml_tensor * src, int from, ggml_tensor * dst, int to, std::vector<uint8_t> & staging) {
    const size_t n = src->nb[1];
    staging.resize(n);
    ggml_backend_tensor_get(src, staging.data(), (size_t) from * n, n);
    ggml_backend_tensor_set(dst, staging.data(), (size_t) to * n, n);
}

void recurrent_state::save_checkpoint(int slot) {
    GGML_ASSERT(slot >= 0 && slot < N_CHECKPOINTS);
    std::vector<uint8_t> staging;
    for (const auto & kv : layers_) {
        const auto & ckpt = checkpoints_.at(kv.first);
        copy_row(kv.second.first, ssm_row_, ckpt.first, slot, staging);
        for (int t = 0; t < conv_window_; ++t) {
            copy_row(kv.second.second, conv_rows_[t], ckpt.second, slot * conv_window_ + t, staging);
        }
    }
}

void recurrent_state::restore_checkpoint(int slot) {
    GGML_ASSERT(slot >= 0 && slot < N_CHECKPOINTS);
    std::vector<uint8_t> staging;
    ssm_row_ = 0;
    conv_rows_from(0);
    for (const auto & kv : layers_) {
        const auto & ckpt = checkpoints_.at(kv.first);
        copy_row(ckpt.first, slot, kv.second.first, ssm_row_, staging);
        for (int t = 0; t < conv_window_; ++t) {
            copy_row(ckpt.second, slot * conv_window_ + t, kv.second.second, conv_rows_[t], staging);
        }
    }
}

void recurrent_state::conv_rows_from(int first) {
    conv_rows_.resize(conv_window_);
    for (int j = 0; j < conv_window_; ++j) {
        conv_rows_[j] = first + j;
    }
}

void recurrent_state::commit(int n_tokens, int k, int i) {
    // the state after token i: the input row when i == 0, else snapshot n-i when it was kept (n-i < k)
    const int s = n_tokens - i;
    // (the conv window of a long evaluation keeps only its last n_rollback inputs: i >= conv_keep_from)
    if (i < conv_keep_from(n_tokens) || i > n_tokens || (i > 0 && s >= k)) {
        throw std::out_of_range(format("commit: cannot keep %d of %d evaluated tokens: the recurrent state was kept "
                                       "only for the last %d tokens of this evaluation (n_rollback = %u; an eval "
                                       "committed whole keeps only its end)", i, n_tokens, k, n_rollback_));
    }
    if (i > 0) {
        ssm_row_ = snapshot_row(s);
    }
    conv_rows_from(i - conv_keep_from(n_tokens));
}

void recurrent_state::commit_node(int j, const int32_t * taps) {
    if (j < 0 || j >= (int) n_rollback_) {
        throw std::out_of_range(format("commit: tree node %d has no kept state (%u nodes are kept)", j, n_rollback_));
    }
    ssm_row_ = snapshot_row(j);
    for (int t = 0; t < conv_window_; ++t) {
        conv_rows_[t] = taps[t + 1];
    }
}

void recurrent_state::commit_no_node() {
    conv_rows_from(0);
}

}  // namespace pdf
