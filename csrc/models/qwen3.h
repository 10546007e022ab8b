// The Qwen3 layer stack, shared by the architectures built on it: GGUF arch `qwen3` (a dense SwiGLU FFN,
// models/qwen3.cpp) and `qwen3moe` (a mixture of experts, models/qwen3moe.cpp). Only the FFN differs, so a subclass
// supplies that and nothing else.
// Per layer: x -> attn_norm -> GQA attention (per-head q/k RMSNorm, NEOX RoPE) -> +x -> ffn_norm -> FFN -> +.
// Legend: n = tokens in the batch, hd = head dim, H / Hkv = query / KV heads, E = n_embd.
#pragma once

#include "models/attention.h"
#include "models/model.h"

#include <memory>
#include <string>
#include <vector>

namespace pdf {

// one layer's attention half and the norm before its FFN
struct qwen3_attention_layer {
    ggml_tensor * attn_norm;
    ggml_tensor * wq;       // [E, hd*H]
    ggml_tensor * wk;       // [E, hd*Hkv]
    ggml_tensor * wv;       // [E, hd*Hkv]
    ggml_tensor * wqkv;     // fused alternative [E, hd*(H+2*Hkv)]
    ggml_tensor * bq, * bk, * bv;
    ggml_tensor * wo;       // [hd*H, E]
    ggml_tensor * q_norm;   // [hd]
    ggml_tensor * k_norm;   // [hd]
    ggml_tensor * ffn_norm; // [E]
};

class qwen3_layers : public target_model {
  protected:
    // reads `{arch}.embedding_length`, `block_count`, `context_length` and the attention keys (each checked against
    // its range and the tensors present) and describes the model as `arch`
    qwen3_layers(std::unique_ptr<gguf_file> file, const std::string & arch);

    // the keys of this architecture start with this ("qwen3.", "qwen3moe.")
    const std::string & key_prefix() const { return prefix_; }
    int64_t             n_embd() const { return n_embd_; }

    // layer il's FFN weights, declared after its attention's and ffn_norm
    virtual void          declare_ffn(weights & w, int il) = 0;
    // layer il's FFN: cur, the normed FFN input [E, n] -> [E, n]
    virtual ggml_tensor * build_ffn(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * cur) const = 0;

  private:
    void          declare_layer(weights & w, int il) final;
    ggml_tensor * build_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const state_tensors & st,
                              int il, ggml_tensor * x, bool last_token_only) const final;
    ggml_tensor * build_self_attention(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                       const state_tensors & st, const qwen3_attention_layer & l, int il,
                                       ggml_tensor * cur, bool last_token_only) const;

    std::string                        prefix_;
    int64_t                            n_embd_ = 0;
    attention_hparams                  att_;
    std::vector<qwen3_attention_layer> layers_;
};

}  // namespace pdf
