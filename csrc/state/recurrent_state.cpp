#include "state/recurrent_state.h"
#include "core/error.h"
#include "core/graph_cache.h"

#include <algorithm>
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
    : n_rollback_(n_rollback), buffers_(4 * info.recurrent_layers.size()) {
    if (n_rollback == 0) {
        throw std::invalid_argument("n_rollback must be at least 1");
    }
    if (info.recurrent_layers.empty()) {
        throw std::invalid_argument("recurrent state for a model without recurrent layers");
    }
    conv_window_ = (int) info.recurrent_layers[0].d_conv - 1;
    for (const recurrent_layer_desc & l : info.recurrent_layers) {
        ggml_backend_buffer_type_t buft = devices.state_buft(l.il);
        const int64_t              W    = l.d_conv - 1;
        layers_[l.il]      = {buffers_.add(GGML_TYPE_F32, l.ssm_size, n_rollback + 1,
                                           format("ssm_states_l%d", l.il), buft),
                              buffers_.add(GGML_TYPE_F32, l.conv_channels, W + n_rollback,
                                           format("conv_states_l%d", l.il), buft)};
        checkpoints_[l.il] = {buffers_.add(GGML_TYPE_F32, l.ssm_size, N_CHECKPOINTS,
                                           format("ssm_checkpoints_l%d", l.il), buft),
                              buffers_.add(GGML_TYPE_F32, l.conv_channels, W * N_CHECKPOINTS,
                                           format("conv_checkpoints_l%d", l.il), buft)};
    }
    if (ggml_backend_buffer_type_t failed = buffers_.allocate()) {
        throw backend_error(format("could not allocate the recurrent state (%.1f MiB in all) in %s",
                                   n_bytes_for(info, n_rollback) / 1048576.0, ggml_backend_buft_name(failed)));
    }
    reset();
}

recurrent_state::~recurrent_state() = default;

void recurrent_state::fill(state_tensors & st, int n_layer) const {
    spread_by_layer(layers_, n_layer, st.ssm, st.conv);
}

size_t recurrent_state::n_bytes() const {
    return memory().total();
}

device_bytes recurrent_state::memory() const {
    return buffers_.memory();
}

void recurrent_state::reset() {
    buffers_.clear();
    ssm_row_ = 0;
    conv_rows_from(0);
}

void recurrent_state::add_inputs(ggml_context * ctx, recurrent_inputs & in, int n_tokens,
                                 const std::vector<int> & tree_levels, int n_snapshots) const {
    const int W  = conv_window_;
    in.conv_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, W);
    ggml_set_input(in.conv_rows);
    if (tree_levels.empty()) {
        in.ssm_row           = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
        in.ssm_snapshot_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_snapshots);
        in.conv_keep_from    = conv_keep_from(n_tokens);
        ggml_set_input(in.ssm_row);
        ggml_set_input(in.ssm_snapshot_rows);
        return;
    }
    const int n0       = tree_levels[0];
    in.tree_levels     = tree_levels;
    in.tree_root_state = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n0);
    in.tree_parent     = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, std::max(1, n_tokens - n0));
    in.tree_state_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    in.tree_out_rows   = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    in.conv_taps       = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) (W + 1) * n_tokens);
    for (ggml_tensor * t : {in.tree_root_state, in.tree_parent, in.tree_state_rows, in.tree_out_rows, in.conv_taps}) {
        ggml_set_input(t);
    }
}

void recurrent_state::set_inputs(const recurrent_inputs & in, const std::vector<int32_t> & parent_slot) {
    set_graph_input(in.conv_rows, conv_rows_.data(), 0, sizeof(int32_t) * conv_window_);
    if (!in.tree_levels.empty()) {
        set_tree_inputs(in, parent_slot);
        return;
    }
    std::vector<int64_t> snapshot_rows(in.ssm_snapshot_rows->ne[0]);
    for (size_t s = 0; s < snapshot_rows.size(); ++s) {
        snapshot_rows[s] = snapshot_row((int) s);
    }
    set_graph_input(in.ssm_row, &ssm_row_, 0, sizeof(int32_t));
    set_graph_input(in.ssm_snapshot_rows, snapshot_rows.data(), 0, sizeof(int64_t) * snapshot_rows.size());
    conv_taps_.clear();
}

void recurrent_state::set_tree_inputs(const recurrent_inputs & in, const std::vector<int32_t> & parent_slot) {
    const int                n = (int) parent_slot.size(), W = conv_window_;
    const std::vector<int> & levels = in.tree_levels;
    // per node: the rows of [window ‖ inputs] under its kernel, oldest first (ancestors, then the window)
    conv_taps_.assign((size_t) n * (W + 1), 0);
    for (int s = 0; s < n; ++s) {
        int32_t * taps = conv_taps_.data() + (size_t) s * (W + 1);
        int       cur = s, w = W - 1;
        for (int t = W; t >= 0; --t) {
            if (cur >= 0) {
                taps[t] = W + cur;
                cur     = parent_slot[cur];
            } else {
                taps[t] = w--;
            }
        }
    }
    std::vector<int32_t> root_state(levels[0], ssm_row_);
    std::vector<int32_t> parent_in_level(std::max(1, n - levels[0]), 0);
    std::vector<int64_t> state_rows(n), out_rows(n);
    for (int s = 0; s < n; ++s) {
        state_rows[s] = snapshot_row(s);
        out_rows[s]   = s;
    }
    // the nodes of depth d >= 1 (slots in level order) have their parents in level d-1
    int parent_level_start = 0, s = levels[0];
    for (size_t d = 1; d < levels.size(); ++d) {
        for (int i = 0; i < levels[d]; ++i, ++s) {
            parent_in_level[s - levels[0]] = parent_slot[s] - parent_level_start;
        }
        parent_level_start += levels[d - 1];
    }
    set_graph_input(in.tree_root_state, root_state.data(), 0, sizeof(int32_t) * root_state.size());
    set_graph_input(in.tree_parent, parent_in_level.data(), 0, sizeof(int32_t) * parent_in_level.size());
    set_graph_input(in.tree_state_rows, state_rows.data(), 0, sizeof(int64_t) * n);
    set_graph_input(in.tree_out_rows, out_rows.data(), 0, sizeof(int64_t) * n);
    set_graph_input(in.conv_taps, conv_taps_.data(), 0, sizeof(int32_t) * conv_taps_.size());
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

void recurrent_state::commit_node(int j) {
    if (j < 0 || j >= (int) n_rollback_) {
        throw std::out_of_range(format("commit: tree node %d has no kept state (%u nodes are kept)", j, n_rollback_));
    }
    ssm_row_              = snapshot_row(j);
    const int32_t * taps = conv_taps_.data() + (size_t) j * (conv_window_ + 1);
    for (int t = 0; t < conv_window_; ++t) {
        conv_rows_[t] = taps[t + 1];
    }
}

void recurrent_state::commit_no_node() {
    conv_rows_from(0);
}

}  // namespace pdf
