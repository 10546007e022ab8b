// The Qwen3 layer stack (models/qwen3.h) and the dense Qwen3 target (GGUF arch `qwen3`, llama.cpp-compatible),
// whose FFN is a SwiGLU.
// Legend: n = tokens in the batch, hd = head dim, H / Hkv = query / KV heads, E = n_embd.
#include "models/qwen3.h"
#include "core/error.h"
#include "models/blocks.h"

#include <cmath>

namespace pdf {

qwen3_layers::qwen3_layers(std::unique_ptr<gguf_file> file, const std::string & arch)
    : target_model(std::move(file)), prefix_(arch + ".") {
    const gguf_file & f = *file_;
    // every hyper-parameter is checked here, against its range and the tensors present (their shapes are checked
    // as they are declared), before any of it sizes an allocation or reaches a ggml op
    n_embd_                    = f.u32_in(prefix_ + "embedding_length", 1, 1 << 20);
    const int      n_layer     = f.block_count(prefix_ + "block_count");
    const uint32_t n_ctx_train = f.u32(prefix_ + "context_length");
    att_                       = load_attention_hparams(f, prefix_, n_embd_);
    describe(arch, n_embd_, n_layer, n_ctx_train, att_.norm_eps);
    for (int il = 0; il < n_layer; ++il) {
        info_.kv_layers.push_back(kv_layer_of(att_, il));
    }
    layers_.resize(n_layer);
}

void qwen3_layers::declare_layer(weights & w, int il) {
    const int64_t E = n_embd_, hd = att_.head_dim;
    const int64_t q_dim = hd * att_.n_head, kv_dim = hd * att_.n_head_kv;
    qwen3_attention_layer & l    = layers_[il];
    auto                    name = [il](const char * s) { return format("blk.%d.%s", il, s); };
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
    declare_ffn(w, il);
}

// x: [E, n] -> [E, n], or [E, 1] for the last token only (K/V still written for all n)
ggml_tensor * qwen3_layers::build_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                        const state_tensors & st, int il, ggml_tensor * x,
                                        bool last_token_only) const {
    const qwen3_attention_layer & l   = layers_[il];
    const float                   eps = att_.norm_eps;
    auto attention = [&](ggml_tensor * cur) {
        return build_self_attention(ctx, gf, in, st, l, il, cur, last_token_only);
    };
    x = build_mixer_residual(ctx, x, l.attn_norm, eps, last_token_only, attention, "ffn_inp", il);
    return build_ffn_residual(ctx, x, l.ffn_norm, eps, [&](ggml_tensor * cur) { return build_ffn(ctx, gf, il, cur); },
                              il);
}

// cur: the normed x [E, n] -> [E, n], or [E, 1] for the last token only (K/V still written for all n)
ggml_tensor * qwen3_layers::build_self_attention(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                                 const state_tensors & st, const qwen3_attention_layer & l, int il,
                                                 ggml_tensor * cur, bool last_token_only) const {
    const int64_t hd = att_.head_dim, H = att_.n_head, Hkv = att_.n_head_kv, n = in.n_tokens;
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
    build_qk_norm_rope(ctx, q, k, l.q_norm, l.k_norm, att_.norm_eps, in.positions, att_.rope);
    ggml_format_name(q, "Qcur-%d", il);
    ggml_format_name(k, "Kcur-%d", il);
    ggml_tensor * o = build_batch_attention(ctx, gf, in, st, il, q, k, v, 1.0f / std::sqrt((float) hd),
                                            last_token_only);  // [hd*H, n or 1]
    return ggml_mul_mat(ctx, l.wo, o);
}

// the dense target: a SwiGLU FFN of width `feed_forward_length`
class qwen3_model : public qwen3_layers {
  public:
    explicit qwen3_model(std::unique_ptr<gguf_file> file) : qwen3_layers(std::move(file), "qwen3") {
        n_ff_ = file_->u32_in(key_prefix() + "feed_forward_length", 1, 1 << 24);
        ffn_.resize(info_.n_layer);
    }

  private:
    void declare_ffn(weights & w, int il) override { ffn_[il] = declare_swiglu(w, n_embd(), n_ff_, il); }

    // cur: [E, n] -> [E, n]
    ggml_tensor * build_ffn(ggml_context * ctx, ggml_cgraph *, int il, ggml_tensor * cur) const override {
        return build_swiglu_ffn(ctx, cur, ffn_[il].gate, ffn_[il].up, ffn_[il].down);
    }

    int64_t                     n_ff_ = 0;
    std::vector<swiglu_weights> ffn_;
};

std::unique_ptr<target_model> open_qwen3(std::unique_ptr<gguf_file> file) {
    return std::make_unique<qwen3_model>(std::move(file));
}

}  // namespace pdf
