// Attention blocks shared by the architectures (Qwen3 targets, Qwen3.5 full-attention layers, the DFlash
// drafter): the hyper-parameters every one of them reads, per-head q/k RMSNorm + RoPE, and attention over a
// session's KV cache. Legend: n = tokens, hd = head dim, H / Hkv = query / KV heads.
#pragma once

#include "core/gguf_file.h"
#include "models/model.h"

#include <string>

namespace pdf {

struct rope_params {
    int   n_rot          = 0;        // rotated dims per head (even, <= hd)
    float freq_base      = 10000.0f;
    int   n_ctx_orig     = 0;        // YaRN: the context the model was pre-trained at
    bool  multi          = false;    // M-RoPE (Qwen3.5: interleaved sections, GGML_ROPE_TYPE_IMROPE)
    int   sections[GGML_MROPE_SECTIONS] = {0, 0, 0, 0};
    // context extension (rope.scaling.*): linear interpolation (freq_scale = 1 / factor) or YaRN (ext_factor 1,
    // beta_fast / beta_slow bound the ramp between extrapolated and interpolated dims); ggml scales the
    // rotation by 1 + 0.1 ln(factor) under YaRN itself, and attn_factor multiplies that
    float freq_scale  = 1.0f;
    float ext_factor  = 0.0f;
    float attn_factor = 1.0f;
    float beta_fast   = 32.0f;
    float beta_slow   = 1.0f;
};

struct attention_hparams {
    int64_t     n_head    = 0;
    int64_t     n_head_kv = 0;
    int64_t     head_dim  = 0;
    float       norm_eps  = 0.0f;  // attention.layer_norm_rms_epsilon (also the layers' RMSNorm epsilon)
    rope_params rope;
};

// `{prefix}attention.head_count` (+ `_kv`), `key_length` (= `value_length`), `layer_norm_rms_epsilon`,
// `rope.dimension_count`, `rope.freq_base`, `rope.scaling.*` and `context_length` of `f`, each checked against
// its valid range: typed errors name the key and the expected and actual values. The head dim defaults to
// n_embd / n_head.
attention_hparams load_attention_hparams(const gguf_file & f, const std::string & prefix, int64_t n_embd);

// the K/V rows one attention layer il with these hyper-parameters keeps (for model_info::kv_layers)
kv_layer_desc kv_layer_of(const attention_hparams & att, int il);

// x: [hd, H, n], positions: I32 [n] (M-RoPE: [4n], section-major) -> rotated x
ggml_tensor * build_rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * positions, const rope_params & rope);

// per-head RMSNorm of q ([hd, H, n]) and k ([hd, Hkv, n]) with their own weights, then RoPE at `positions`
void build_qk_norm_rope(ggml_context * ctx, ggml_tensor *& q, ggml_tensor *& k, ggml_tensor * q_norm,
                        ggml_tensor * k_norm, float eps, ggml_tensor * positions, const rope_params & rope);

// q: [hd, H, n], k: [hd, Hkv, n], v: [hdv, Hkv, n] (already normed and rotated)
// writes k, v into cache slots in.slots of layer il, then attends over cache rows 0..in.n_kv-1 with
// in.kq_mask: all n queries, or with last_query_only the last token's alone. returns [hdv*H, n] / [hdv*H, 1]
ggml_tensor * build_kv_attention(ggml_context * ctx, ggml_cgraph * gf, const kv_inputs & in,
                                 const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                 float scale, bool last_query_only = false);

// build_kv_attention for each session of the batch (models/sequences.h) on its own rows, cache and mask; the
// same shapes (with last_query_only: one session's batch only)
ggml_tensor * build_batch_attention(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                    ggml_tensor * v, float scale, bool last_query_only = false);

}  // namespace pdf
