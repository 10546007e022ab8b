// Gated delta net blocks (Qwen3.5's recurrent layers), free functions over stock ggml ops, for a chain of
// tokens and for a tree of them (DDTree verification: every node starts from its parent's state).
// Shapes: n = tokens, S = head dim (k = v), Hk / Hv = key / value heads, C = conv channels, W = d_conv - 1.
// The state rows they read and write are described with recurrent_inputs (core/model_desc.h).
#pragma once

#include "models/model.h"

namespace pdf {

// L2 normalisation over ne0 as llama.cpp builds it for gated delta net: rms_norm(x, eps/n) / sqrt(n)
ggml_tensor * build_l2_norm(ggml_context * ctx, ggml_tensor * x, float eps);

// The conv window of a chain x: [C, n]: the W rows of st.conv[il] at in.conv_rows, read out ([C, W]) before
// the kept tail of [window ‖ x] (from in.conv_keep_from) is written back over them.
ggml_tensor * read_conv_window(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                               const state_tensors & st, int il, ggml_tensor * x, int64_t d_conv);

// The short causal convolution of N sequences: window [C, W, N], x [C, n, N] -> conv [C, n*N] (before the
// SiLU), one ssm_conv over every sequence's [window ‖ x].
ggml_tensor * build_ssm_conv(ggml_context * ctx, ggml_tensor * window, ggml_tensor * x, ggml_tensor * kernel);

// Short causal convolution with kept state, chain. x: [C, n] -> conv [C, n] (before the SiLU, which the caller
// applies once over every session's rows). Reads the window and writes the kept tail back (read_conv_window).
ggml_tensor * build_conv_chain(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                               const state_tensors & st, int il, ggml_tensor * x, ggml_tensor * kernel);

// The same for a tree (rows in level order): each node's kernel covers its ancestors (in.conv_taps).
// kernel_t: the kernel transposed, [C, d_conv].
ggml_tensor * build_conv_tree(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                              const state_tensors & st, int il, ggml_tensor * x, ggml_tensor * kernel_t);

// The gated-delta-net inputs of tokens from .. n-1 (q, k: [S, Hk, n], v: [S, Hv, n], g, beta: [1, Hv, n],
// token rows contiguous) into step rows 0 .., for a commit of some of them to recompute their state from.
void keep_delta_steps(ggml_context * ctx, ggml_cgraph * gf, const state_tensors & st, int il, ggml_tensor * q,
                      ggml_tensor * k, ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta, int64_t from);

// Gated delta rule, chain. q, k: [S, Hk, n], v: [S, Hv, n], g, beta: [1, Hv, n]. Reads the state row in.ssm_row
// of st.ssm[il]; writes the state after token in.ssm_split_at (0: after the last) to row in.ssm_out_row and,
// with in.keep_steps, the inputs of the tokens from there on to step rows 0.. (core/model_desc.h). Returns
// [S, Hv, n].
ggml_tensor * build_gated_delta_net(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                                    const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                    ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta);

// The state of layer l after L kept steps (step rows `steps`, I32 [L], in order) from the state in row `from`
// (I32 [1]), written to row `to` (I64 [1]; may be `from`: the state is read before it is written). The same op
// over the same inputs as the evaluation that kept them, token by token, so the same bits as the state that
// evaluation computed for its last step. Returns the write.
ggml_tensor * build_state_after_steps(ggml_context * ctx, ggml_cgraph * gf, const state_tensors & st,
                                      const recurrent_layer_desc & l, ggml_tensor * steps, ggml_tensor * from,
                                      ggml_tensor * to);

// The same in the chunked (WY) form of the delta rule, for a chain committed whole (the final state to
// in.ssm_out_row, no steps kept): chunks of DELTA_NET_CHUNK tokens become matmuls and one triangular solve each,
// and the state passes from chunk to chunk; only stock ops (mul_mat, cumsum, tri, solve_tri, exp), so it runs
// where ggml_gated_delta_net does not (Vulkan in the pinned ggml), as llama.cpp's chunked path does.
ggml_tensor * build_gated_delta_net_chunked(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                                            const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                            ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta);
constexpr int64_t DELTA_NET_CHUNK = 64;
// graph nodes the chunked form adds per layer: a fixed part and one per chunk (upper bounds)
constexpr size_t DELTA_NET_CHUNKED_NODES = 64, DELTA_NET_CHUNKED_NODES_PER_CHUNK = 16;

// The same for a tree (rows in level order), level by level: the nodes of one depth run as independent
// one-token sequences whose input states are gathered from their parents' states (the level before), so no
// more than two levels' states are ever held. None is written back: node j's inputs go to step row j, from
// which a commit recomputes its path's state (build_state_after_steps). Only stock ops.
ggml_tensor * build_gated_delta_net_tree(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & in,
                                         const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                         ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta);

// graph nodes one tree-evaluated gated-delta-net layer adds per level (an upper bound)
constexpr size_t DELTA_NET_TREE_NODES_PER_LEVEL = 16;

}  // namespace pdf
