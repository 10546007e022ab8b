#include "state/recurrent_state.h"
#include "core/error.h"
#include "core/graph_cache.h"
#include "models/delta_net.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace pdf {

size_t recurrent_state::n_bytes_for(const model_info & info, uint32_t n_rollback) {
    size_t n = 0;
    for (const recurrent_layer_desc & l : info.recurrent_layers) {
        n += sizeof(float) * (size_t) l.ssm_size * SSM_ROWS;
        n += sizeof(float) * (size_t) (l.step_width() + 2 * l.n_v_heads) * n_rollback;
        n += sizeof(float) * (size_t) l.conv_channels * ((size_t) l.d_conv - 1 + n_rollback);
        n += sizeof(float) * ((size_t) l.ssm_size + (size_t) l.conv_channels * (l.d_conv - 1)) * N_CHECKPOINTS;
    }
    return n;
}

// the commit graphs' inputs: the step rows of the kept tokens, the state row they start from, the row written
struct recurrent_state::commit_graph {
    explicit commit_graph(graph_arena & arena) : cache(arena) {}
    graph_cache   cache;
    ggml_tensor * steps = nullptr;  // I32 [n_steps]
    ggml_tensor * from  = nullptr;  // I32 [1]
    ggml_tensor * to    = nullptr;  // I64 [1]
};

// graph nodes of a commit graph, per recurrent layer (an upper bound) and in all
static constexpr size_t COMMIT_NODES_PER_LAYER = 16;

recurrent_state::recurrent_state(const model_info & info, const backends & devices, const compute_backends & compute,
                                 uint32_t n_rollback)
    : layer_descs_(info.recurrent_layers), n_rollback_(n_rollback), buffers_(7 * info.recurrent_layers.size()),
      commit_arena_(compute) {
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
        layers_[l.il]      = {buffers_.add(GGML_TYPE_F32, l.ssm_size, SSM_ROWS, format("ssm_states_l%d", l.il), buft),
                              buffers_.add(GGML_TYPE_F32, l.conv_channels, W + n_rollback,
                                           format("conv_states_l%d", l.il), buft)};
        // the prompt cache's copies go through the host anyway (copy_row), and wait there: no GPU memory for them
        ggml_backend_buffer_type_t host = devices.host_state_buft();
        checkpoints_[l.il] = {buffers_.add(GGML_TYPE_F32, l.ssm_size, N_CHECKPOINTS,
                                           format("ssm_checkpoints_l%d", l.il), host),
                              buffers_.add(GGML_TYPE_F32, l.conv_channels, W * N_CHECKPOINTS,
                                           format("conv_checkpoints_l%d", l.il), host)};
        steps_[l.il]       = {buffers_.add(GGML_TYPE_F32, l.step_width(), n_rollback, format("step_qkv_l%d", l.il), buft),
                              buffers_.add(GGML_TYPE_F32, l.n_v_heads, n_rollback, format("step_g_l%d", l.il), buft),
                              buffers_.add(GGML_TYPE_F32, l.n_v_heads, n_rollback, format("step_beta_l%d", l.il),
                                           buft)};
    }
    commit_arena_.sched_for(16 + COMMIT_NODES_PER_LAYER * layer_descs_.size());
    if (ggml_backend_buffer_type_t failed = buffers_.allocate()) {
        throw backend_error(format("could not allocate the recurrent state (%.1f MiB in all) in %s",
                                   n_bytes_for(info, n_rollback) / 1048576.0, ggml_backend_buft_name(failed)));
    }
    reset();
}

recurrent_state::~recurrent_state() = default;

void recurrent_state::fill(state_tensors & st, int n_layer) const {
    spread_by_layer(layers_, n_layer, st.ssm, st.conv);
    st.step_qkv.assign(n_layer, nullptr);
    st.step_g.assign(n_layer, nullptr);
    st.step_beta.assign(n_layer, nullptr);
    for (const auto & kv : steps_) {
        st.step_qkv[kv.first]  = kv.second.qkv;
        st.step_g[kv.first]    = kv.second.g;
        st.step_beta[kv.first] = kv.second.beta;
    }
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
                                 const std::vector<int> & tree_levels, bool whole) const {
    const int W  = conv_window_;
    in.conv_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, W);
    ggml_set_input(in.conv_rows);
    if (tree_levels.empty()) {
        in.ssm_row        = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
        in.ssm_out_row    = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, 1);
        in.ssm_split_at   = split_at(n_tokens, whole);
        // a commit of part of a chain recomputes its state from the kept steps; one token is kept whole or not
        // at all, so it needs none
        in.keep_steps     = !whole && n_tokens > 1;
        in.conv_keep_from = conv_keep_from(n_tokens);
        ggml_set_input(in.ssm_row);
        ggml_set_input(in.ssm_out_row);
        return;
    }
    const int n0       = tree_levels[0];
    in.tree_levels     = tree_levels;
    in.keep_steps      = true;
    in.tree_root_state = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n0);
    in.tree_parent     = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, std::max(1, n_tokens - n0));
    in.tree_out_rows   = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    in.conv_taps       = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) (W + 1) * n_tokens);
    for (ggml_tensor * t : {in.tree_root_state, in.tree_parent, in.tree_out_rows, in.conv_taps}) {
        ggml_set_input(t);
    }
}

void recurrent_state::set_inputs(const recurrent_inputs & in, const std::vector<int32_t> & parent_slot) {
    set_graph_input(in.conv_rows, conv_rows_.data(), 0, sizeof(int32_t) * conv_window_);
    if (!in.tree_levels.empty()) {
        set_tree_inputs(in, parent_slot);
        return;
    }
    const int64_t out = out_row();
    set_graph_input(in.ssm_row, &ssm_row_, 0, sizeof(int32_t));
    set_graph_input(in.ssm_out_row, &out, 0, sizeof(int64_t));
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
    std::vector<int64_t> out_rows(n);
    for (int s = 0; s < n; ++s) {
        out_rows[s] = s;
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

void recurrent_state::commit(int n_tokens, bool whole, int i) {
    const int b = split_at(n_tokens, whole);
    // (the conv window of a long evaluation keeps only its last n_rollback inputs: i >= conv_keep_from)
    if (i < conv_keep_from(n_tokens) || i > n_tokens || (i > 0 && i < n_tokens && (whole || i < b))) {
        throw std::out_of_range(format("commit: cannot keep %d of %d evaluated tokens: the recurrent state was kept "
                                       "only for the last %d tokens of this evaluation (n_rollback = %u; an eval "
                                       "committed whole keeps only its end)", i, n_tokens,
                                       whole ? 1 : std::min<int>(n_tokens, n_rollback_), n_rollback_));
    }
    if (i == n_tokens && b == 0) {
        ssm_row_ = out_row();  // the evaluation wrote the state after its last token
    } else if (i > 0) {
        // from the state the evaluation wrote (after token b; b = 0: the committed one) through steps 0 .. i-b-1
        std::vector<int32_t> steps(i - b);
        std::iota(steps.begin(), steps.end(), 0);
        if (!steps.empty()) {
            recompute(steps, b > 0 ? out_row() : ssm_row_);
        } else {
            ssm_row_ = out_row();
        }
    }
    conv_rows_from(i - conv_keep_from(n_tokens));
}

void recurrent_state::commit_path(const std::vector<int32_t> & slots) {
    const int j = slots.empty() ? -1 : slots.back();
    if (j < 0 || j >= (int) n_rollback_ || (size_t) (j + 1) * (conv_window_ + 1) > conv_taps_.size()) {
        throw std::out_of_range(format("commit: tree node %d has no kept state (%u nodes are kept)", j, n_rollback_));
    }
    recompute(slots, ssm_row_);
    const int32_t * taps = conv_taps_.data() + (size_t) j * (conv_window_ + 1);
    for (int t = 0; t < conv_window_; ++t) {
        conv_rows_[t] = taps[t + 1];
    }
}

recurrent_state::commit_graph & recurrent_state::commit_graph_for(int n_steps) {
    std::unique_ptr<commit_graph> & g = commit_graphs_[n_steps];
    if (g) {
        return *g;
    }
    g                  = std::make_unique<commit_graph>(commit_arena_);
    ggml_context * ctx = g->cache.begin(16 + COMMIT_NODES_PER_LAYER * layer_descs_.size());
    g->steps           = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_steps);
    g->from            = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
    g->to              = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, 1);
    for (ggml_tensor * t : {g->steps, g->from, g->to}) {
        ggml_set_input(t);
    }
    state_tensors st;
    fill(st, layer_descs_.back().il + 1);
    for (const recurrent_layer_desc & l : layer_descs_) {
        build_state_after_steps(ctx, g->cache.graph(), st, l, g->steps, g->from, g->to);
    }
    return *g;
}

void recurrent_state::recompute(const std::vector<int32_t> & steps, int32_t from) {
    commit_graph & g  = commit_graph_for((int) steps.size());
    const int64_t  to = out_row();
    g.cache.allocate("the recurrent state's commit graph");
    set_graph_input(g.steps, steps.data(), 0, sizeof(int32_t) * steps.size());
    set_graph_input(g.from, &from, 0, sizeof(int32_t));
    set_graph_input(g.to, &to, 0, sizeof(int64_t));
    g.cache.compute("the recurrent state's commit graph");
    ssm_row_ = (int32_t) to;
}

size_t recurrent_state::measure_commit() {
    return commit_graph_for((int) n_rollback_).cache.measure();
}

void recurrent_state::commit_no_node() {
    conv_rows_from(0);
}

}  // namespace pdf
