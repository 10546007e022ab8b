// Graph blocks shared by the architectures, each a free function over stock ggml ops (attention in
// models/attention.h, gated delta net in models/delta_net.h).
// Shapes in ggml order (ne0 innermost): n = n_tokens, hd = head dim, H = heads.
#pragma once

#include "models/model.h"

#include <functional>

namespace pdf {

// x: [n_embd, n] -> rms_norm(x) * w
ggml_tensor * build_rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w, float eps);

// x: [n_embd, n] -> down(silu(gate x) * up x): [n_embd, n]
ggml_tensor * build_swiglu_ffn(ggml_context * ctx, ggml_tensor * x, ggml_tensor * gate, ggml_tensor * up,
                               ggml_tensor * down);

// a dense SwiGLU FFN's weights, blk.il.ffn_{gate,up,down}.weight (the dense targets' FFN)
struct swiglu_weights {
    ggml_tensor * gate;  // [n_embd, n_ff]
    ggml_tensor * up;    // [n_embd, n_ff]
    ggml_tensor * down;  // [n_ff, n_embd]
};
swiglu_weights declare_swiglu(weights & w, int64_t n_embd, int64_t n_ff, int il);

// the first half of a pre-norm layer il: x [n_embd, n] -> x + mixer(rms_norm(x) * norm), named `name`-il. The mixer
// (attention, a recurrent block) maps the normed x to [n_embd, n], or with last_token_only to [n_embd, 1]: only
// x's last token then takes it
ggml_tensor * build_mixer_residual(ggml_context * ctx, ggml_tensor * x, ggml_tensor * norm, float eps,
                                   bool last_token_only, const std::function<ggml_tensor *(ggml_tensor *)> & mixer,
                                   const char * name, int il);

// the feed-forward half of a pre-norm layer il: x [n_embd, n] -> x + ffn(rms_norm(x) * norm), named l_out-il (the
// ffn: a SwiGLU, a mixture of experts; [n_embd, n] -> [n_embd, n])
ggml_tensor * build_ffn_residual(ggml_context * ctx, ggml_tensor * x, ggml_tensor * norm, float eps,
                                 const std::function<ggml_tensor *(ggml_tensor *)> & ffn, int il);

// An evaluation that returns only the last token's hidden state needs, past the last layer's K/V (and recurrent
// state) writes, only that token: its query, residual and FFN (llama.cpp's inp_out_ids). Not when the final
// hidden state (capture index n_layer) is wanted for every token.
bool last_layer_for_last_token_only(const eval_inputs & in, int n_layer);
// x: [d0, n] or [d0, d1, n] -> the last token's slice (a view) [d0, 1] / [d0, d1, 1]
ggml_tensor * last_token(ggml_context * ctx, ggml_tensor * x);

}  // namespace pdf
