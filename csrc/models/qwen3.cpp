// Qwen3 dense target (GGUF arch `qwen3`, llama.cpp-compatible).
// Per layer: x -> attn_norm -> GQA attention (per-head q/k RMSNorm, NEOX RoPE) -> +x -> ffn_norm -> SwiGLU -> +.
// Legend: n = tokens in the batch, hd = head dim, H / Hkv = query / KV heads, V = vocab.
#include "core/error.h"
#include "models/attention.h"
#include "models/blocks.h"
#include "models/model.h"

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
    qwen3_model(std::unique_ptr<gguf_file> file, const model_params & params) {
        file_                = std::move(file);
        const gguf_file & f  = *file_;
        const std::string a  = "qwen3.";
        // every hyper-parameter is checked here, against its range and the tensors present (their shapes are
        // checked as they are loaded below), before any of it sizes an allocation or reaches a ggml op
        hp_.n_embd           = f.u32_in(a + "embedding_length", 1, 1 << 20);
        hp_.n_layer          = f.block_count(a + "block_count");
        hp_.n_ctx_train      = f.u32(a + "context_length");
        hp_.n_ff             = f.u32_in(a + "feed_forward_length", 1, 1 << 24);
        hp_.att              = load_attention_hparams(f, a, hp_.n_embd);

        ggml_tensor * embd = f.find_tensor("token_embd.weight");
        if (!embd) {
            throw format_error(format("%s: missing required tensor 'token_embd.weight'", f.path().c_str()));
        }
        const int64_t n_vocab = embd->ne[1];

        info_.arch        = "qwen3";
        info_.path        = f.path();
        info_.n_vocab     = n_vocab;
        info_.n_embd      = hp_.n_embd;
        info_.n_layer     = hp_.n_layer;
        info_.n_ctx_train = hp_.n_ctx_train;
        const int64_t hd = hp_.att.head_dim, E = hp_.n_embd;
        for (int il = 0; il < hp_.n_layer; ++il) {
            info_.kv_layers.push_back({il, hd * hp_.att.n_head_kv, hd * hp_.att.n_head_kv, hd, hd});
        }

        backends_ = std::make_unique<backends>(params.n_threads, params.n_gpu_layers, hp_.n_layer, params.plan_only);
        weights_  = std::make_unique<weights>(f, *backends_);
        weights & w = *weights_;
        const int out_il = hp_.n_layer;
        load_embedding_and_head(E, n_vocab);
        output_norm_ = w.require("output_norm.weight", {E}, out_il, WEIGHT_USE_OTHER);
        const int64_t q_dim = hd * hp_.att.n_head, kv_dim = hd * hp_.att.n_head_kv;
        layers_.resize(hp_.n_layer);
        for (int il = 0; il < hp_.n_layer; ++il) {
            qwen3_layer & l = layers_[il];
            auto name = [il](const char * s) { return format("blk.%d.%s", il, s); };
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
        w.load(params.progress);
    }

    // x: [E, n] -> hidden [E, n_outputs] after the final norm (n_outputs = n, or 1 without in.all_outputs)
    eval_outputs build_eval(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                            const state_tensors & st) const override {
        const int64_t hd = hp_.att.head_dim, H = hp_.att.n_head, Hkv = hp_.att.n_head_kv, n = in.n_tokens;
        const float   eps   = hp_.att.norm_eps;
        const float   scale = 1.0f / std::sqrt((float) hd);
        eval_outputs  out;
        out.captured.assign(in.capture_layers.size(), nullptr);

        const bool    last_only = last_layer_for_last_token_only(in, hp_.n_layer);
        ggml_tensor * x = ggml_get_rows(ctx, tok_embd_, in.tokens);  // [E, n]
        for (int il = 0; il <= hp_.n_layer; ++il) {
            // DFlash reads layer inputs (llama.cpp's t_layer_inp); index n_layer is the final pre-norm output
            for (size_t c = 0; c < in.capture_layers.size(); ++c) {
                if (in.capture_layers[c] == il) {
                    out.captured[c] = x;
                }
            }
            if (il == hp_.n_layer) {
                break;
            }
            const qwen3_layer & l = layers_[il];
            ggml_tensor *       cur = build_rms_norm(ctx, x, l.attn_norm, eps);
            ggml_format_name(cur, "attn_norm-%d", il);

            // self-attention
            ggml_tensor *q, *k, *v;
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
            build_qk_norm_rope(ctx, q, k, l.q_norm, l.k_norm, eps, in.positions, hp_.att.rope);
            ggml_format_name(q, "Qcur-%d", il);
            ggml_format_name(k, "Kcur-%d", il);

            const bool last_token_only = il == hp_.n_layer - 1 && last_only;
            cur = build_kv_attention(ctx, gf, in, st, il, q, k, v, scale, last_token_only);  // [hd*H, n or 1]
            if (last_token_only) {
                x = last_token(ctx, x);
            }
            cur = ggml_mul_mat(ctx, l.wo, cur);
            x   = ggml_add(ctx, cur, x);
            ggml_format_name(x, "ffn_inp-%d", il);

            // feed-forward
            cur = build_rms_norm(ctx, x, l.ffn_norm, eps);
            cur = build_swiglu_ffn(ctx, cur, l.ffn_gate, l.ffn_up, l.ffn_down);
            x   = ggml_add(ctx, cur, x);
            ggml_format_name(x, "l_out-%d", il);
        }

        if (!in.all_outputs && x->ne[1] > 1) {
            x = last_token(ctx, x);  // the final hidden state was captured for every token
        }
        out.hidden = build_rms_norm(ctx, x, output_norm_, eps);
        return out;
    }

  private:
    qwen3_hparams            hp_{};
    ggml_tensor *            output_norm_ = nullptr;
    std::vector<qwen3_layer> layers_;
};

std::unique_ptr<target_model> load_qwen3(std::unique_ptr<gguf_file> file, const model_params & params) {
    return std::make_unique<qwen3_model>(std::move(file), params);
}

}  // namespace pdf
