// Gated-delta-net state of every recurrent layer of one session, kept so that a batched evaluation of up
// to n_rollback tokens (a chain, or a tree of nodes) can be committed at ANY token without re-running the
// target, in memory that does not grow with the state of every token.
//
// Per layer:
//   ssm  [D, 2]                     D = S_v*S_v*H_v. The committed state is one row; an evaluation reads it and
//                                   writes one state to the other row (a chain's last, the input stays as it
//                                   was: committing no token costs nothing and nothing copies it).
//   step_qkv, step_g, step_beta     [2*S*Hk + S*Hv | Hv | Hv, n_rollback]: an evaluation's per-token inputs of the
//                                   delta rule (q, k after their norm, v, g, beta; ~40 KB a token on a 27B, against
//                                   ~3 MB of state). A commit of a chain prefix or a tree path recomputes the kept
//                                   tokens' state from the committed one with the same op over the same inputs,
//                                   so the same bits as the evaluation computed (build_state_after_steps), in a
//                                   small graph of its own; a chain kept whole needs none.
//   conv [conv_channels, d_conv-1+n_rollback]  rows of [conv window ‖ new conv inputs] (time = rows); the next
//                                   evaluation reads the d_conv-1 rows named by conv_rows().
// A tree evaluation thus holds no per-node state beyond two levels' inside its graph.
#pragma once

#include "core/backend.h"
#include "core/graph_cache.h"
#include "core/model_desc.h"
#include "state/state_buffers.h"

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

namespace pdf {

class recurrent_state {
  public:
    recurrent_state(const model_info & info, const backends & devices, const compute_backends & compute,
                    uint32_t n_rollback);
    ~recurrent_state();
    recurrent_state(const recurrent_state &)             = delete;
    recurrent_state & operator=(const recurrent_state &) = delete;

    static size_t n_bytes_for(const model_info & info, uint32_t n_rollback);

    ggml_tensor * ssm(int il) const { return layers_.at(il).first; }
    ggml_tensor * conv(int il) const { return layers_.at(il).second; }
    static constexpr int SSM_ROWS = 2;
    // the state tensors by layer index, for the graph builders
    void          fill(state_tensors & st, int n_layer) const;
    uint32_t      n_rollback() const { return n_rollback_; }
    int           conv_window() const { return conv_window_; }  // d_conv - 1
    size_t        n_bytes() const;
    device_bytes  memory() const;

    // rows the next evaluation reads
    int32_t                      ssm_row() const { return ssm_row_; }
    const std::vector<int32_t> & conv_rows() const { return conv_rows_; }  // oldest first

    // a chain evaluation of n tokens: the token whose state it writes (0: the last; committed whole: always the
    // last) and from which on it keeps its steps (the last n_rollback tokens); the first row of
    // [window ‖ inputs] it writes back to the conv buffer
    int split_at(int n_tokens, bool whole) const { return whole ? 0 : std::max(0, n_tokens - (int) n_rollback_); }
    int conv_keep_from(int n_tokens) const { return std::max<int>(0, n_tokens - (int) n_rollback_); }

    // the graph inputs of an evaluation of n_tokens (core/model_desc.h), new in ctx: a chain (tree_levels empty;
    // whole: committed whole) or a tree of those levels
    void add_inputs(ggml_context * ctx, recurrent_inputs & in, int n_tokens, const std::vector<int> & tree_levels,
                    bool whole) const;
    // sets them from the rows the committed state is in; a tree's nodes (in level order) have parent_slot (-1:
    // the committed past)
    void set_inputs(const recurrent_inputs & in, const std::vector<int32_t> & parent_slot);

    // after a chain evaluation of n tokens (whole: committed whole), keep the state as of its first i tokens
    // (throws std::out_of_range if it cannot: i before the kept steps, or 0 < i < n of a whole one)
    void commit(int n_tokens, bool whole, int i);
    // after a tree evaluation (n <= n_rollback nodes): keep the state of the path `slots` (level-order slots,
    // root first) and the last node's conv window, i.e. the last d_conv-1 of its conv taps
    void commit_path(const std::vector<int32_t> & slots);
    // after a tree evaluation, keep none of it: the input state, and the window it wrote back to rows 0..W-1
    void commit_no_node();
    // compute bytes of the graph a commit runs (its own buffer, sized by the longest: n_rollback steps), measured
    // by ggml's allocator; and what is allocated for it so far
    size_t       measure_commit();
    device_bytes commit_compute_memory() const { return commit_arena_.memory(); }
    // back to the empty state (zeros)
    void reset();

    // Copies of the committed state, apart from the rows evaluations write: the prompt cache keeps the state
    // at two points of the last prompt (state/session.h) so that a later request sharing it continues from there.
    // They are kept in system memory (backends::host_state_buft), wherever the layers are.
    static constexpr int N_CHECKPOINTS = 2;
    void save_checkpoint(int slot);
    // the committed state becomes the one saved in `slot`
    void restore_checkpoint(int slot);

  private:
    struct commit_graph;
    void conv_rows_from(int first);  // the window: d_conv-1 consecutive rows from `first`
    int32_t out_row() const { return 1 - ssm_row_; }  // the row an evaluation or a commit writes
    // the state after `steps` (step rows, in order) from row `from`, into out_row(), which becomes the committed
    // row
    void recompute(const std::vector<int32_t> & steps, int32_t from);
    commit_graph & commit_graph_for(int n_steps);
    // a tree's inputs: the conv taps and the state rows of every node
    void set_tree_inputs(const recurrent_inputs & in, const std::vector<int32_t> & parent_slot);

    std::vector<recurrent_layer_desc> layer_descs_;
    uint32_t             n_rollback_;
    int                  conv_window_ = 0;
    int32_t              ssm_row_     = 0;
    std::vector<int32_t> conv_rows_;
    std::vector<int32_t> conv_taps_;  // the last tree evaluation's, [n, d_conv]
    state_buffers        buffers_;
    layer_tensors        layers_;
    struct step_tensors {
        ggml_tensor *qkv, *g, *beta;
    };
    std::map<int, step_tensors> steps_;
    // per layer: ssm [D, N_CHECKPOINTS], conv [conv_channels, (d_conv-1) * N_CHECKPOINTS]
    layer_tensors        checkpoints_;
    // commits that recompute run here, apart from the evaluations' compute buffer (no re-planning of a verify
    // graph after each commit), one graph per number of steps, built when first needed
    graph_arena                                   commit_arena_;
    std::map<int, std::unique_ptr<commit_graph>> commit_graphs_;
};

}  // namespace pdf
