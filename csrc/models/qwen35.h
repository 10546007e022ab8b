// The Qwen3.5 hybrid layer stack, shared by the architectures built on it: GGUF arch `qwen35` (a dense SwiGLU FFN,
// models/qwen35.cpp) and `qwen35moe` (a mixture of experts and a shared expert, models/qwen35moe.cpp). Only the FFN
// differs, so a subclass supplies that and nothing else.
// Gated-delta-net layers and, every full_attention_interval-th layer, gated full attention with interleaved M-RoPE.
// Per layer: x -> attn_norm -> (GDN | attention) -> +x -> post_attention_norm -> FFN -> +.
// Legend: n = tokens, E = n_embd, hd = attention head dim, H / Hkv = query / KV heads,
//         S = GDN head dim (k = v), Hk / Hv = GDN key / value heads, C = conv channels = 2*S*Hk + S*Hv.
// MTP: the first MTP block (index n_layer), when the file has it, is loaded as the target's own draft head
// (target_model::build_mtp): a full-attention layer with this stack's FFN, behind nextn.eh_proj. Further MTP
// blocks are not loaded (the head is applied repeatedly, as llama.cpp's draft-mtp does).
#pragma once

#include "models/attention.h"
#include "models/model.h"

#include <memory>
#include <string>
#include <vector>

namespace pdf {

struct qwen35_hparams {
    int64_t           n_embd;
    int               n_layer;      // main-pass layers (block_count minus nextn_predict_layers)
    int               n_layer_all;  // block_count: per-layer key arrays have this many entries
    uint32_t          n_ctx_train;
    attention_hparams att;          // the full-attention layers (M-RoPE); att.norm_eps is every RMSNorm's
    int64_t           d_conv;       // ssm.conv_kernel
    int64_t           S;            // ssm.state_size: GDN head dim (k and v)
    int64_t           Hk;           // ssm.group_count
    int64_t           Hv;           // ssm.time_step_rank
    std::vector<bool> recurrent;
};

// one layer's mixer (gated delta net or gated attention) and the norm before its FFN
struct qwen35_layer {
    ggml_tensor * attn_norm;
    ggml_tensor * post_attention_norm;
    // gated delta net
    ggml_tensor * wqkv;       // [E, C]
    ggml_tensor * wgate;      // [E, S*Hv]   (z)
    ggml_tensor * ssm_conv1d; // [d_conv, C]
    ggml_tensor * ssm_conv1d_t; // [C, d_conv]: the same, per channel (tree evaluation)
    ggml_tensor * ssm_dt;     // [Hv]
    ggml_tensor * ssm_a;      // [Hv]  (-exp(A_log))
    ggml_tensor * ssm_beta;   // [E, Hv]
    ggml_tensor * ssm_alpha;  // [E, Hv]
    ggml_tensor * ssm_norm;   // [S]
    ggml_tensor * ssm_out;    // [S*Hv, E]
    // full attention
    ggml_tensor * wq;         // [E, 2*hd*H]: per head [q | gate]
    ggml_tensor * wk, * wv;   // [E, hd*Hkv]
    ggml_tensor * wo;         // [hd*H, E]
    ggml_tensor * q_norm, * k_norm;  // [hd]
};

// the MTP block's own tensors (blk.{n_layer}.nextn.*), besides its layer's
struct qwen35_mtp {
    ggml_tensor * eh_proj   = nullptr;  // [2E, E]: [normed embedding ‖ normed hidden state] -> the layer's input
    ggml_tensor * enorm     = nullptr;  // [E]
    ggml_tensor * hnorm     = nullptr;  // [E]
    ggml_tensor * embed     = nullptr;  // [E, V] or nullptr: the target's token embedding
    ggml_tensor * head      = nullptr;  // [E, V] or nullptr: the target's output head
    ggml_tensor * head_norm = nullptr;  // [E] or nullptr: the target's final norm
};

class qwen35_layers : public target_model {
  public:
    size_t max_graph_nodes(int n_tree_levels, int n_tokens) const override;

    bool          has_mtp() const override { return mtp_il_ >= 0; }
    std::string   mtp_missing() const override { return mtp_missing_; }
    kv_layer_desc mtp_kv_layer() const override { return kv_layer_of(hp_.att, hp_.n_layer); }
    ggml_tensor * build_mtp(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const state_tensors & st,
                            ggml_tensor * h, bool last_only) const override;
    ggml_tensor * mtp_output_head() const override { return mtp_.head ? mtp_.head : output_head(); }
    size_t        mtp_graph_nodes() const override { return 256; }

  protected:
    // reads `{arch}.` embedding_length, block_count (less nextn_predict_layers), context_length, the attention,
    // M-RoPE and ssm keys and the recurrent layers (each checked against its range and the tensors present) and
    // describes the model as `arch`
    qwen35_layers(std::unique_ptr<gguf_file> file, const std::string & arch);

    // the keys of this architecture start with this ("qwen35.", "qwen35moe.")
    const std::string & key_prefix() const { return prefix_; }
    const qwen35_hparams & hparams() const { return hp_; }

    // layers with an FFN: the main pass's and the loaded MTP block (index n_layer)
    int n_ffn_layers() const { return hp_.n_layer + (mtp_il_ >= 0 ? 1 : 0); }
    // layer il's FFN weights, declared after its norms and before its mixer's
    virtual void          declare_ffn(weights & w, int il) = 0;
    // layer il's FFN: cur, the normed FFN input [E, n] -> [E, n]
    virtual ggml_tensor * build_ffn(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * cur) const = 0;

  private:
    void read_mrope_sections(const gguf_file & f, const std::string & a);
    void read_delta_net_hparams(const gguf_file & f, const std::string & a);
    void read_recurrent_layers(const gguf_file & f, const std::string & a, int n_layer_all);
    void read_mtp_presence(const gguf_file & f, uint32_t n_mtp);
    void declare_layer(weights & w, int il) final;
    void declare_extra(weights & w) final;
    void loaded(const model_params & params) final { choose_delta_net_form(params.delta_net); }
    ggml_tensor * build_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in, const state_tensors & st,
                              int il, ggml_tensor * x, bool last_token_only) const final;
    ggml_tensor * build_gdn_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                  const state_tensors & st, const qwen35_layer & l, int il, ggml_tensor * x,
                                  bool last_token_only) const;
    bool          chunked_form(int il, const recurrent_inputs & rin, int64_t n) const;
    ggml_tensor * build_delta_rule(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & rin,
                                   const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                   ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) const;
    ggml_tensor * build_attention_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                        const state_tensors & st, const qwen35_layer & l, int il, ggml_tensor * x,
                                        bool last_token_only) const;
    void          choose_delta_net_form(delta_net_form form);

    std::string               prefix_;
    qwen35_hparams            hp_{};
    std::vector<qwen35_layer> layers_;
    int                       mtp_il_ = -1;  // the loaded MTP block's layer index (n_layer), -1: none
    qwen35_mtp                mtp_;
    std::string               mtp_missing_;
    std::vector<bool>         chunked_;
    bool                      any_chunked_ = false;
};

}  // namespace pdf
