// Graph blocks shared by the architectures, each a free function over stock ggml ops.
// Shapes in ggml order (ne0 innermost): n = n_tokens, hd = head dim, H = heads, Hkv = KV heads.
#pragma once

#include "models/model.h"
#include "state/kv_cache.h"

namespace pdf {

// x: [n_embd, n] -> rms_norm(x) * w
ggml_tensor * build_rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w, float eps);

// x: [n_embd, n] -> down(silu(gate x) * up x): [n_embd, n]
ggml_tensor * build_swiglu_ffn(ggml_context * ctx, ggml_tensor * x, ggml_tensor * gate, ggml_tensor * up,
                               ggml_tensor * down);

// x: [hd, H, n], positions: I32 [n] -> NEOX rotation of the first n_rot dims of each head
ggml_tensor * build_rope_neox(ggml_context * ctx, ggml_tensor * x, ggml_tensor * positions, int n_rot,
                              float freq_base, int n_ctx_orig);

// An evaluation that returns only the last token's logits needs, past the last layer's K/V (and recurrent
// state) writes, only that token: its query, residual and FFN (llama.cpp's inp_out_ids). Not when the final
// hidden state (capture index n_layer) is wanted for every token.
bool last_layer_for_last_token_only(const eval_inputs & in, int n_layer);
// x: [d0, n] or [d0, d1, n] -> the last token's slice (a view) [d0, 1] / [d0, d1, 1]
ggml_tensor * last_token(ggml_context * ctx, ggml_tensor * x);

// q: [hd, H, n], k: [hd, Hkv, n], v: [hdv, Hkv, n] (already normed and rotated)
// writes k, v into cache slots in.kv_slots, then attends over cache rows 0..in.n_kv-1 with in.kq_mask: all n
// queries, or with last_query_only the last token's alone. returns [hdv*H, n] / [hdv*H, 1]
ggml_tensor * build_kv_attention(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const kv_cache & kv,
                                 int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float scale,
                                 bool last_query_only = false);

}  // namespace pdf

namespace pdf {

class recurrent_state;

// L2 normalisation over ne0 as llama.cpp builds it for gated delta net: rms_norm(x, eps/n) / sqrt(n)
ggml_tensor * build_l2_norm(ggml_context * ctx, ggml_tensor * x, float eps);

// Short causal convolution with kept state. x: [channels, n] -> silu(conv) [channels, n].
// Reads the window (d_conv-1 rows of rs.conv(il)) at in.conv_rows, writes the kept tail back.
ggml_tensor * build_conv_with_state(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const recurrent_state & rs, int il, ggml_tensor * x, ggml_tensor * kernel);

// Gated delta rule with per-token snapshots. q, k: [S, Hk, n], v: [S, Hv, n], g, beta: [1, Hv, n].
// Reads the state row in.ssm_row of rs.ssm(il), writes the snapshots back. Returns [S, Hv, n].
ggml_tensor * build_gated_delta_net(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const recurrent_state & rs, int il, ggml_tensor * q, ggml_tensor * k,
                                    ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta);

}  // namespace pdf
