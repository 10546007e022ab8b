// Gated-delta-net state of every recurrent layer of one session, kept so that a batched evaluation of up
// to n_rollback tokens (a chain, or a tree of nodes) can be committed at ANY token without re-running the
// target.
//
// Per layer:
//   ssm  [D, n_rollback+1]              D = S_v*S_v*H_v. An evaluation reads its input state from one row and
//                                       writes per-token states into the other rows, so the input state
//                                       stays where it was (committing no token costs nothing, and nothing
//                                       copies it). Chain: ggml_gated_delta_net's snapshots, the state after
//                                       token n-1-s in the s-th other row; tree: node j's state in the j-th.
//   conv [conv_channels, d_conv-1+n_rollback]  rows of [conv window ‖ new conv inputs] (time = rows); the next
//                                       evaluation reads the d_conv-1 rows named by conv_rows().
// Committing is then only a choice of rows: no copy, no replay, no host round trip.
#pragma once

#include "core/backend.h"
#include "core/model_desc.h"
#include "state/state_buffers.h"

#include <vector>

namespace pdf {

class recurrent_state {
  public:
    recurrent_state(const model_info & info, const backends & devices, uint32_t n_rollback);
    ~recurrent_state();
    recurrent_state(const recurrent_state &)             = delete;
    recurrent_state & operator=(const recurrent_state &) = delete;

    static size_t n_bytes_for(const model_info & info, uint32_t n_rollback);

    ggml_tensor * ssm(int il) const { return layers_.at(il).first; }
    ggml_tensor * conv(int il) const { return layers_.at(il).second; }
    // the state tensors by layer index, for the graph builders
    void          fill(state_tensors & st, int n_layer) const;
    uint32_t      n_rollback() const { return n_rollback_; }
    int           conv_window() const { return conv_window_; }  // d_conv - 1
    size_t        n_bytes() const;
    device_bytes  memory() const;

    // rows the next evaluation reads
    int32_t                      ssm_row() const { return ssm_row_; }
    const std::vector<int32_t> & conv_rows() const { return conv_rows_; }  // oldest first

    // chain evaluation of n tokens: the snapshots it keeps (the last k tokens' states; k = 1 when it is committed
    // whole), the row of snapshot s (most recent first: the s-th row that is not the input row), and the first
    // row of [window ‖ inputs] it writes back to the conv buffer
    int     n_snapshots(int n_tokens, bool whole = false) const {
        return whole ? 1 : std::min<int>(n_tokens, (int) n_rollback_);
    }
    int32_t snapshot_row(int s) const { return s < ssm_row_ ? s : s + 1; }
    int     conv_keep_from(int n_tokens) const { return std::max<int>(0, n_tokens - (int) n_rollback_); }

    // the graph inputs of an evaluation of n_tokens (core/model_desc.h), new in ctx: a chain keeping n_snapshots
    // states (tree_levels empty), or a tree of those levels
    void add_inputs(ggml_context * ctx, recurrent_inputs & in, int n_tokens, const std::vector<int> & tree_levels,
                    int n_snapshots) const;
    // sets them from the rows the committed state is in; a tree's nodes (in level order) have parent_slot (-1:
    // the committed past)
    void set_inputs(const recurrent_inputs & in, const std::vector<int32_t> & parent_slot);

    // after a chain evaluation of n tokens that kept k states, keep the state as of its first i tokens
    // (throws if not kept)
    void commit(int n_tokens, int k, int i);
    // after a tree evaluation (n <= n_rollback nodes): keep node j's state (row snapshot_row(j)) and its conv
    // window, i.e. the last d_conv-1 of the node's conv taps (rows of [window ‖ inputs], oldest first)
    void commit_node(int j);
    // after a tree evaluation, keep none of it: the input state, and the window it wrote back to rows 0..W-1
    void commit_no_node();
    // back to the empty state (zeros)
    void reset();

    // Copies of the committed state, apart from the rows evaluations write: the prompt cache keeps the state
    // at two points of the last prompt (state/session.h) so that a later request sharing it continues from there.
    static constexpr int N_CHECKPOINTS = 2;
    void save_checkpoint(int slot);
    // the committed state becomes the one saved in `slot`
    void restore_checkpoint(int slot);

  private:
    void conv_rows_from(int first);  // the window: d_conv-1 consecutive rows from `first`
    // a tree's inputs: the conv taps and the state rows of every node
    void set_tree_inputs(const recurrent_inputs & in, const std::vector<int32_t> & parent_slot);

    uint32_t             n_rollback_;
    int                  conv_window_ = 0;
    int32_t              ssm_row_     = 0;
    std::vector<int32_t> conv_rows_;
    std::vector<int32_t> conv_taps_;  // the last tree evaluation's, [n, d_conv]
    state_buffers        buffers_;
    layer_tensors        layers_;
    // per layer: ssm [D, N_CHECKPOINTS], conv [conv_channels, (d_conv-1) * N_CHECKPOINTS]
    layer_tensors        checkpoints_;
};

}  // namespace pdf
