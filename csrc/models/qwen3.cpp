// Qwen3 dense target (GGUF arch `qwen3`, llama.cpp-compatible).
// Per layer: x -> attn_norm -> GQA attention (per-head q/k RMSNorm, NEOX RoPE) -> +x -> ffn_norm -> SwiGLU -> +.
// Legend: n = tokens in the batch, hd = head dim, H / Hkv = query / KV heads, V = vocab.
#include "core/error.h"
#include "models/attention.h"
#include "models/blocks.h"

#include <cmath>

namespace pdf {

struct qwen3_hparams {
    int64_t           n_embd;
    int64_t           n_ff;
    int               n_layer;
    uint32_t          n_ctx_train;
    attention_hparams att;
};

struct qwen3_layer {
    ggml_tensor * attn_norm;
    ggml_tensor * wq;       // [n_embd, hd*H]
    ggml_tensor * wk;       // [n_embd, hd*Hkv]
    ggml_tensor * wv;       // [n_embd, hd*Hkv]
    ggml_tensor * wqkv;     // fused alternative [n_embd, hd*(H+2*Hkv)]
    ggml_tensor * bq, * bk, * bv;
    ggml_tensor * wo;       // [hd*H, n_embd]
    ggml_tensor * q_norm;   // [hd]
    ggml_tensor * k_norm;   // [hd]
    ggml_tensor * ffn_norm;
    ggml_tensor * ffn_gate; // [n_embd, n_ff]
    ggml_tensor * ffn_up;   // [n_embd, n_ff]
    ggml_tensor * ffn_down; // [n_ff, n_embd]
};

class qwen3_model : public target_model {
  public:
    explicit qwen3_model(std::unique_ptr<gguf_file> file) : target_model(std::move(file)) {
        const gguf_file & f = *file_;
        const std::string a = "qwen3.";
        // every hyper-parameter is checked here, against its range and the tensors present (their shapes are
        // checked as they are declared below), before any of it sizes an allocation or reaches a ggml op
        hp_.n_embd      = f.u32_in(a + "embedding_length", 1, 1 << 20);
        hp_.n_layer     = f.block_count(a + "block_count");
        hp_.n_ctx_train = f.u32(a + "context_length");
        hp_.n_ff        = f.u32_in(a + "feed_forward_length", 1, 1 << 24);
        hp_.att         = load_attention_hparams(f, a, hp_.n_embd);
        describe("qwen3", hp_.n_embd, hp_.n_layer, hp_.n_ctx_train, hp_.att.norm_eps);
        for (int il = 0; il < hp_.n_layer; ++il) {
            info_.kv_layers.push_back(kv_layer_of(hp_.att, il));
        }
        layers_.resize(hp_.n_layer);
    }

  private:
    void declare_layer(weights & w, int il) override {
        const int64_t E = hp_.n_embd, hd = hp_.att.head_dim;
        const int64_t q_dim = hd * hp_.att.n_head, kv_dim = hd * hp_.att.n_head_kv;
        qwen3_layer & l    = layers_[il];
        auto          name = [il](const char * s) { return format("blk.%d.%s", il, s); };
        l.attn_norm = w.require(name("attn_norm.weight"), {E}, il, WEIGHT_USE_OTHER);
        l.wqkv      = w.optional(name("attn_qkv.weight"), {E, q_dim + 2 * kv_dim}, il, WEIGHT_USE_MATMUL);
        if (!l.wqkv) {
            l.wq = w.require(name("attn_q.weight"), {E, q_dim}, il, WEIGHT_USE_MATMUL);
            l.wk = w.require(name("attn_k.weight"), {E, kv_dim}, il, WEIGHT_USE_MATMUL);
            l.wv = w.require(name("attn_v.weight"), {E, kv_dim}, il, WEIGHT_USE_MATMUL);
        }
        l.bq       = w.optional(name("attn_q.bias"), {q_dim}, il, WEIGHT_USE_OTHER);
        l.bk       = w.optional(name("attn_k.bias"), {kv_dim}, il, WEIGHT_USE_OTHER);
        l.bv       = w.optional(name("attn_v.bias"), {kv_dim}, il, WEIGHT_USE_OTHER);
        l.wo       = w.require(name("attn_output.weight"), {q_dim, E}, il, WEIGHT_USE_MATMUL);
        l.q_norm   = w.require(name("attn_q_norm.weight"), {hd}, il, WEIGHT_USE_OTHER);
        l.k_norm   = w.require(name("attn_k_norm.weight"), {hd}, il, WEIGHT_USE_OTHER);
        l.ffn_norm = w.require(name("ffn_norm.weight"), {E}, il, WEIGHT_USE_OTHER);
        l.ffn_gate = w.require(name("ffn_gate.weight"), {E, hp_.n_ff}, il, WEIGHT_USE_MATMUL);
        l.ffn_up   = w.require(name("ffn_up.weight"), {E, hp_.n_ff}, il, WEIGHT_USE_MATMUL);
        l.ffn_down = w.require(name("ffn_down.weight"), {hp_.n_ff, E}, il, WEIGHT_USE_MATMUL);
    }

    // x: [E, n] -> [E, n], or [E, 1] for the last token only (K/V still written for all n)
    ggml_tensor * build_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const state_tensors & st,
                              int il, ggml_tensor * x, bool last_token_only) const override {
        const qwen3_layer & l   = layers_[il];
        const float         eps = hp_.att.norm_eps;
        auto attention = [&](ggml_tensor * cur) {
            return build_self_attention(ctx, gf, in, st, l, il, cur, last_token_only);
        };
        x = build_mixer_residual(ctx, x, l.attn_norm, eps, last_token_only, attention, "ffn_inp", il);
        return build_swiglu_residual(ctx, x, l.ffn_norm, l.ffn_gate, l.ffn_up, l.ffn_down, eps, il);
    }

    // cur: the normed x [E, n] -> [E, n], or [E, 1] for the last token only (K/V still written for all n)
    ggml_tensor * build_self_attention(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                       const state_tensors & st, const qwen3_layer & l, int il, ggml_tensor * cur,
                                       bool last_token_only) const {
        const int64_t hd = hp_.att.head_dim, H = hp_.att.n_head, Hkv = hp_.att.n_head_kv, n = in.n_tokens;
        ggml_format_name(cur, "attn_norm-%d", il);
        ggml_tensor * q, * k, * v;
        if (l.wqkv) {
            ggml_tensor * qkv = ggml_mul_mat(ctx, l.wqkv, cur);  // [hd*(H+2Hkv), n]
            q = ggml_view_3d(ctx, qkv, hd, H, n, hd * sizeof(float), qkv->nb[1], 0);
            k = ggml_view_3d(ctx, qkv, hd, Hkv, n, hd * sizeof(float), qkv->nb[1], hd * H * sizeof(float));
            v = ggml_view_3d(ctx, qkv, hd, Hkv, n, hd * sizeof(float), qkv->nb[1], hd * (H + Hkv) * sizeof(float));
            v = ggml_cont(ctx, v);
        } else {
            q = ggml_mul_mat(ctx, l.wq, cur);
            k = ggml_mul_mat(ctx, l.wk, cur);
            v = ggml_mul_mat(ctx, l.wv, cur);
            if (l.bq) q = ggml_add(ctx, q, l.bq);
            if (l.bk) k = ggml_add(ctx, k, l.bk);
            if (l.bv) v = ggml_add(ctx, v, l.bv);
            q = ggml_reshape_3d(ctx, q, hd, H, n);
            k = ggml_reshape_3d(ctx, k, hd, Hkv, n);
            v = ggml_reshape_3d(ctx, v, hd, Hkv, n);
        }
        build_qk_norm_rope(ctx, q, k, l.q_norm, l.k_norm, hp_.att.norm_eps, in.positions, hp_.att.rope);
        ggml_format_name(q, "Qcur-%d", il);
        ggml_format_name(k, "Kcur-%d", il);
        ggml_tensor * o = build_kv_attention(ctx, gf, in.kv, st, il, q, k, v, 1.0f / std::sqrt((float) hd),
                                             last_token_only);  // [hd*H, n or 1]
        return ggml_mul_mat(ctx, l.wo, o);
    }

    qwen3_hparams            hp_{};
    std::vector<qwen3_layer> layers_;
};

std::unique_ptr<target_model> open_qwen3(std::unique_ptr<gguf_file> file) {
    return std::make_unique<qwen3_model>(std::move(file));
}

}  // namespace pdf
