// Gated-delta-net state of every recurrent layer of one session, kept so that a batched evaluation of up
// to n_rollback tokens can be committed at ANY token without re-running the target.
//
// Per layer:
//   ssm  [D, n_rollback+1]              D = S_v*S_v*H_v. An evaluation reads its input state from one row
//                                       and writes the state after token n-s (s < K = min(n, n_rollback),
//                                       ggml_gated_delta_net's snapshots, most recent first) into the s-th of
//                                       the other rows, so the input state stays where it was (committing 0
//                                       tokens costs nothing, and nothing copies it).
//   conv [conv_channels, d_conv-1+n_rollback]  the tail of [conv window ‖ new conv inputs] (time = rows);
//                                       the next evaluation reads d_conv-1 consecutive rows.
// Committing i of the n tokens is then only a choice of rows: no copy, no replay, no host round trip.
#pragma once

#include "models/model.h"

#include <map>
#include <vector>

namespace pdf {

class recurrent_state {
  public:
    recurrent_state(const target_model & model, uint32_t n_rollback);
    ~recurrent_state();
    recurrent_state(const recurrent_state &)             = delete;
    recurrent_state & operator=(const recurrent_state &) = delete;

    static size_t n_bytes_for(const model_info & info, uint32_t n_rollback);

    ggml_tensor * ssm(int il) const { return layers_.at(il).first; }
    ggml_tensor * conv(int il) const { return layers_.at(il).second; }
    uint32_t      n_rollback() const { return n_rollback_; }
    size_t        n_bytes() const;

    // rows the next evaluation reads
    int32_t ssm_row() const { return ssm_row_; }
    int32_t conv_row() const { return conv_row_; }  // first of d_conv-1 consecutive rows

    // snapshots an evaluation of n tokens keeps
    int n_snapshots(int n_tokens) const { return std::min<int>(n_tokens, (int) n_rollback_); }
    // the row the next evaluation writes its snapshot s to (most recent first): the s-th row that is not
    // the input row, which thus keeps the state as of no token
    int32_t snapshot_row(int s) const { return s < ssm_row_ ? s : s + 1; }
    // first row of [window ‖ inputs] that an evaluation of n tokens keeps in the conv buffer
    int conv_keep_from(int n_tokens) const { return std::max<int>(0, n_tokens - (int) n_rollback_); }

    // after an evaluation of n tokens, keep the state as of its first i tokens (throws if not kept)
    void commit(int n_tokens, int i);
    // back to the empty state (zeros)
    void reset();

  private:
    uint32_t                                              n_rollback_;
    int32_t                                               ssm_row_  = 0;
    int32_t                                               conv_row_ = 0;
    ggml_context *                                        ctx_      = nullptr;
    std::vector<ggml_backend_buffer_t>                    buffers_;
    std::map<int, std::pair<ggml_tensor *, ggml_tensor *>> layers_;
};

}  // namespace pdf
