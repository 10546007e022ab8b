#include "models/attention.h"
#include "core/error.h"
#include "models/blocks.h"
#include "models/sequences.h"

#include <algorithm>
#include <cmath>

namespace pdf {

// rope.scaling.*, read as llama.cpp does (a factor without a type is linear; the legacy rope.scale_linear is
// the factor's old name; YaRN's original context defaults to the training context) with YaRN's attention
// factor meaning what transformers' `attention_factor` means: the whole cos/sin scale
static void load_rope_scaling(const gguf_file & f, const std::string & prefix, rope_params & rope) {
    const std::string & path       = f.path();
    const std::string   key        = prefix + "rope.scaling.";
    const std::string   type       = f.has_key(key + "type") ? f.str(key + "type") : "linear";
    const std::string   factor_key = f.has_key(key + "factor") ? key + "factor" : prefix + "rope.scale_linear";
    const float         factor     = f.has_key(factor_key) && f.f32(factor_key) == 0.0f
                                         ? 0.0f  // llama.cpp writes 0 for "not scaled"
                                         : f.f32_in_or(factor_key, 0.0f, 0.0f, 1e6f);
    rope.attn_factor = f.f32_in_or(key + "attn_factor", 1.0f, 0.0f, 1e3f);
    if (type == "none" || factor == 0.0f || factor == 1.0f) {
        return;
    }
    if (type == "linear") {
        rope.freq_scale = 1.0f / factor;
    } else if (type == "yarn") {
        if (factor < 1.0f) {  // (YaRN extends a context; its mscale 1 + 0.1 ln(factor) would reach 0 below 1)
            throw format_error(format("%s: key '%s' = %g with YaRN scaling, expected a factor >= 1", path.c_str(),
                                      factor_key.c_str(), (double) factor));
        }
        rope.freq_scale = 1.0f / factor;
        const std::string orig_key = f.has_key(key + "original_context_length") ? key + "original_context_length"
                                                                                 : prefix + "context_length";
        rope.n_ctx_orig = (int) f.u32_in(orig_key, 1, INT32_MAX);
        rope.ext_factor = f.has_key(key + "yarn_ext_factor") && f.f32(key + "yarn_ext_factor") == 0.0f
                              ? 0.0f
                              : f.f32_in_or(key + "yarn_ext_factor", 1.0f, 0.0f, 1e3f);
        rope.beta_fast  = f.f32_in_or(key + "yarn_beta_fast", 32.0f, 0.0f, 1e6f);
        rope.beta_slow  = f.f32_in_or(key + "yarn_beta_slow", 1.0f, 0.0f, 1e6f);
        if (f.has_key(key + "yarn_log_multiplier") && f.f32(key + "yarn_log_multiplier") != 0.0f) {
            throw unsupported_error(format("%s: %srope.scaling.yarn_log_multiplier = %g (DeepSeek-style YaRN "
                                           "mscale) is not supported", path.c_str(), prefix.c_str(),
                                           (double) f.f32(key + "yarn_log_multiplier")));
        }
        // the cos/sin scale: the file's, else YaRN's 1 + 0.1 ln(factor); ggml multiplies by
        // 1 + 0.1 ln(factor) itself whenever ext_factor != 0, so that part is divided out
        const float default_scale = 1.0f + 0.1f * std::log(factor);
        const float scale         = f.f32_in_or(key + "yarn_attn_factor", default_scale, 0.0f, 1e3f);
        rope.attn_factor *= rope.ext_factor != 0.0f ? scale / default_scale : scale;
    } else {
        throw unsupported_error(format("%s: %srope.scaling.type = '%s' is not supported (expected none, linear or "
                                       "yarn)", path.c_str(), prefix.c_str(), type.c_str()));
    }
}

attention_hparams load_attention_hparams(const gguf_file & f, const std::string & prefix, int64_t n_embd) {
    const std::string & path = f.path();
    attention_hparams   hp;
    hp.n_head    = f.u32_in(prefix + "attention.head_count", 1, 1 << 16);
    hp.n_head_kv = f.u32_in_or(prefix + "attention.head_count_kv", (uint32_t) hp.n_head, 1, (uint32_t) hp.n_head);
    if (hp.n_head % hp.n_head_kv != 0) {
        throw format_error(format("%s: %sattention.head_count = %lld must be a multiple of "
                                  "attention.head_count_kv = %lld", path.c_str(), prefix.c_str(),
                                  (long long) hp.n_head, (long long) hp.n_head_kv));
    }
    const std::string key_length = prefix + "attention.key_length";
    hp.head_dim = f.has_key(key_length) ? f.u32_in(key_length, 2, 1 << 16) : n_embd / hp.n_head;
    if (hp.head_dim < 2 || hp.head_dim % 2 != 0) {
        throw format_error(format("%s: the head dim (%s = %lld) must be even and at least 2", path.c_str(),
                                  f.has_key(key_length) ? key_length.c_str() : "embedding_length / head_count",
                                  (long long) hp.head_dim));
    }
    const uint32_t v_len = f.u32_or(prefix + "attention.value_length", (uint32_t) hp.head_dim);
    if (v_len != hp.head_dim) {
        throw unsupported_error(format("%s: %sattention.value_length = %u differs from key_length = %lld",
                                       path.c_str(), prefix.c_str(), v_len, (long long) hp.head_dim));
    }
    // ggml requires eps >= 0; 0 turns an all-zero row into NaN, and anything near 1 is not a real model
    hp.norm_eps        = f.f32_in(prefix + "attention.layer_norm_rms_epsilon", 0.0f, 1.0f);
    hp.rope.n_rot      = (int) f.u32_in_or(prefix + "rope.dimension_count", (uint32_t) hp.head_dim, 2,
                                           (uint32_t) hp.head_dim);
    hp.rope.freq_base  = f.f32_in_or(prefix + "rope.freq_base", 10000.0f, 1.0f, 1e12f);
    hp.rope.n_ctx_orig = (int) std::min<uint32_t>(f.u32_or(prefix + "context_length", 0), INT32_MAX);
    if (hp.rope.n_rot % 2 != 0) {
        throw format_error(format("%s: %srope.dimension_count = %d must be even", path.c_str(), prefix.c_str(),
                                  hp.rope.n_rot));
    }
    load_rope_scaling(f, prefix, hp.rope);
    return hp;
}

kv_layer_desc kv_layer_of(const attention_hparams & att, int il) {
    const int64_t hd = att.head_dim;
    return {il, hd * att.n_head_kv, hd * att.n_head_kv, hd, hd};
}

ggml_tensor * build_rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * positions, const rope_params & rope) {
    if (rope.multi) {
        int sections[GGML_MROPE_SECTIONS];
        std::copy(rope.sections, rope.sections + GGML_MROPE_SECTIONS, sections);
        return ggml_rope_multi(ctx, x, positions, nullptr, rope.n_rot, sections, GGML_ROPE_TYPE_IMROPE,
                               rope.n_ctx_orig, rope.freq_base, rope.freq_scale, rope.ext_factor, rope.attn_factor,
                               rope.beta_fast, rope.beta_slow);
    }
    return ggml_rope_ext(ctx, x, positions, nullptr, rope.n_rot, GGML_ROPE_TYPE_NEOX, rope.n_ctx_orig, rope.freq_base,
                         rope.freq_scale, rope.ext_factor, rope.attn_factor, rope.beta_fast, rope.beta_slow);
}

void build_qk_norm_rope(ggml_context * ctx, ggml_tensor *& q, ggml_tensor *& k, ggml_tensor * q_norm,
                        ggml_tensor * k_norm, float eps, ggml_tensor * positions, const rope_params & rope) {
    q = build_rope(ctx, ggml_mul(ctx, ggml_rms_norm(ctx, q, eps), q_norm), positions, rope);
    k = build_rope(ctx, ggml_mul(ctx, ggml_rms_norm(ctx, k, eps), k_norm), positions, rope);
}

// the attended V window (bytes per layer) up to which the CPU uses plain matmul attention (see below), for
// windows counted in steps of SMALL_WINDOW_STEP slots: the bound was chosen with the windows of 256-slot steps,
// and a session attending in finer steps must not move a model onto this path where flash attention is
// faster for it (Qwen3-0.6B decode over its first 128 tokens: ~12% slower)
static constexpr size_t SMALL_WINDOW_BYTES = 256 * 1024;
static constexpr int    SMALL_WINDOW_STEP  = 256;

ggml_tensor * build_kv_attention(ggml_context * ctx, ggml_cgraph * gf, const kv_inputs & in,
                                 const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                 float scale, bool last_query_only) {
    const int64_t hd    = q->ne[0];
    const int64_t H     = q->ne[1];
    const int64_t hdv   = v->ne[0];
    const int64_t Hkv   = k->ne[1];
    const int64_t n_new = k->ne[2];
    ggml_tensor * kq_mask = in.kq_mask;  // [n_kv, n_new]
    if (last_query_only) {
        q       = last_token(ctx, q);
        kq_mask = last_token(ctx, kq_mask);
    }
    const int64_t n = q->ne[2];  // queries

    ggml_tensor * k_cache = st.k[il];  // [hd*Hkv, n_ctx]
    ggml_tensor * v_cache = st.v[il];  // [hdv*Hkv, n_ctx]

    // Q first, then the cache writes, so that the reads below see them. Q must be complete before attention
    // starts: CUDA launches each kernel before the one before it ends (programmatic dependent launch, on by
    // default on Hopper), the fused Q norm+rope kernel lets its successor start before it writes Q, and the
    // flash-attention vector kernel (a window a multiple of 256 slots, one query) reads Q through __restrict__
    // (non-coherent) loads that may be scheduled before its wait for the kernel before it. The writes between,
    // whose kernels wait for their predecessors before letting theirs start, keep them apart, as llama.cpp
    // orders them (llama-graph.cpp, build_attn). With Q placed right before attention, greedy decoding on an
    // H100 went wrong from its third token over a 256-slot window, only with CUDA graphs (qwen3; qwen35's Q rope
    // is not fused); with this order an H200 decoded 400 tokens across 256- and 512-slot windows as the CPU does
    // (tests/test_gpu.py, plain decoding over long windows, 2026-11-27).
    ggml_build_forward_expand(gf, q);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, k_cache, ggml_reshape_2d(ctx, k, hd * Hkv, n_new), in.slots));
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, v_cache, ggml_reshape_2d(ctx, v, hdv * Hkv, n_new), in.slots));

    // cache rows 0..n_kv-1 as [hd, n_kv, Hkv]
    ggml_tensor * k_view = ggml_view_3d(ctx, k_cache, hd, Hkv, in.n_kv, ggml_row_size(k_cache->type, hd),
                                        k_cache->nb[1], 0);
    ggml_tensor * v_view = ggml_view_3d(ctx, v_cache, hdv, Hkv, in.n_kv, ggml_row_size(v_cache->type, hdv),
                                        v_cache->nb[1], 0);
    k_view = ggml_permute(ctx, k_view, 0, 2, 1, 3);
    v_view = ggml_permute(ctx, v_view, 0, 2, 1, 3);

    ggml_tensor * q_perm = ggml_permute(ctx, q, 0, 2, 1, 3);  // [hd, n, H]

    // Small attention windows on the CPU: matmuls + softmax (f32 accumulation) instead of ggml's CPU flash
    // attention, whose path for 1..63 queries converts every K/V row per query head and accumulates an f16 V
    // in f16: ~45% of a DFlash round on the trained qwen3 pair. The choice depends only on the window, never
    // on the batch size, so a verify block and single-token decoding round alike (mixing the two kernels
    // made speculative output part from plain decoding on 10 of 16 prompts, q8_0 pair, f16 cache).
    // P·V needs V with the cache rows innermost, i.e. a transposed copy of the window. ggml's CPU copy of a
    // transposed view of the same type moves each element with its own memcpy (17% of a tiny model's decode
    // step at a 1K window), while a copy between two types is a typed loop: so an f16 V is transposed into
    // f32 and converted back (contiguous, vectorized), which made decoding on the demo pair ~1.3x faster. It
    // stays f16 for the matmul: the same numbers as before, which keep our greedy tokens equal to llama.cpp's
    // (an all-f32 P·V parted from them beyond near-ties on q8_0 test models). The copy grows with the window,
    // which is what bounds it (quantized V rows cannot be transposed at all).
    const bool   cpu_cache = ggml_backend_buffer_is_host(k_cache->buffer);
    const bool   plain_kv  = (k_cache->type == GGML_TYPE_F16 || k_cache->type == GGML_TYPE_F32) &&
                          (v_cache->type == GGML_TYPE_F16 || v_cache->type == GGML_TYPE_F32);
    const size_t v_window  = (size_t) GGML_PAD(in.n_kv, SMALL_WINDOW_STEP) * ggml_row_size(v_cache->type, hdv * Hkv);
    if (cpu_cache && plain_kv && n < 64 && v_window <= SMALL_WINDOW_BYTES) {
        ggml_tensor * kq = ggml_mul_mat(ctx, k_view, q_perm);  // [n_kv, n, H]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        kq                = ggml_soft_max_ext(ctx, kq, kq_mask, scale, 0.0f);
        ggml_tensor * v_t = ggml_transpose(ctx, v_view);  // [n_kv, hdv, Hkv]
        v_t = v_cache->type == GGML_TYPE_F16 ? ggml_cast(ctx, ggml_cast(ctx, v_t, GGML_TYPE_F32), GGML_TYPE_F16)
                                             : ggml_cont(ctx, v_t);
        ggml_tensor * kqv = ggml_mul_mat(ctx, v_t, kq);  // [hdv, n, H]
        return ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hdv * H, n);  // [hdv*H, n]
    }
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q_perm, k_view, v_view, kq_mask, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    return ggml_reshape_2d(ctx, out, hdv * H, n);  // out: [hdv, H, n]
}

ggml_tensor * build_batch_attention(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                    const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                    ggml_tensor * v, float scale, bool last_query_only) {
    if (in.sequences.empty()) {
        return build_kv_attention(ctx, gf, in.kv, st, il, q, k, v, scale, last_query_only);
    }
    GGML_ASSERT(!last_query_only);
    std::vector<ggml_tensor *> outs;
    for (const sequence_part & p : sequence_parts(in, st)) {
        outs.push_back(build_kv_attention(ctx, gf, *p.kv, *p.st, il, token_range(ctx, q, 2, p.first, p.n),
                                          token_range(ctx, k, 2, p.first, p.n), token_range(ctx, v, 2, p.first, p.n),
                                          scale));  // [hdv*H, n_s]
    }
    return join_tokens(ctx, outs, 1);
}

}  // namespace pdf
