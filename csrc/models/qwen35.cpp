// The Qwen3.5 hybrid layer stack (models/qwen35.h) and the dense Qwen3.5 target (GGUF arch `qwen35`,
// llama.cpp-compatible), whose FFN is a SwiGLU.
// Legend: n = tokens, E = n_embd, hd = attention head dim, H / Hkv = query / KV heads,
//         S = GDN head dim (k = v), Hk / Hv = GDN key / value heads, C = conv channels = 2*S*Hk + S*Hv.
#include "models/qwen35.h"
#include "core/error.h"
#include "models/blocks.h"
#include "models/delta_net.h"
#include "models/delta_net_batch.h"
#include "models/sequences.h"

#include <algorithm>
#include <cmath>

namespace pdf {

qwen35_layers::qwen35_layers(std::unique_ptr<gguf_file> file, const std::string & arch)
    : target_model(std::move(file)), prefix_(arch + ".") {
    const gguf_file & f = *file_;
    const std::string & a = prefix_;
    // every hyper-parameter is checked here, against its range and the tensors present (their shapes are
    // checked as they are declared below), before any of it sizes an allocation or reaches a ggml op
    const uint32_t n_mtp = f.u32_in_or(a + "nextn_predict_layers", 0, 0, 64);
    // MTP blocks come last and may have been left out of the file
    const int n_layer_all = f.block_count(a + "block_count", n_mtp);
    hp_.n_layer           = n_layer_all - (int) n_mtp;
    hp_.n_layer_all       = n_layer_all;
    if (hp_.n_layer <= 0) {
        throw format_error(format("%s: block_count %d minus nextn_predict_layers %u leaves no layer",
                                  f.path().c_str(), n_layer_all, n_mtp));
    }
    hp_.n_embd      = f.u32_in(a + "embedding_length", 1, 1 << 20);
    hp_.n_ctx_train = f.u32(a + "context_length");
    hp_.att         = load_attention_hparams(f, a, hp_.n_embd);
    read_mrope_sections(f, a);
    read_delta_net_hparams(f, a);
    read_recurrent_layers(f, a, n_layer_all);
    describe(arch, hp_.n_embd, hp_.n_layer, hp_.n_ctx_train, hp_.att.norm_eps);
    info_.n_pos_per_token = 4;
    const int64_t S = hp_.S, C = 2 * S * hp_.Hk + S * hp_.Hv;
    for (int il = 0; il < hp_.n_layer; ++il) {
        if (hp_.recurrent[il]) {
            info_.recurrent_layers.push_back({il, S * S * hp_.Hv, C, hp_.d_conv, S, hp_.Hk, hp_.Hv});
        } else {
            info_.kv_layers.push_back(kv_layer_of(hp_.att, il));
        }
    }
    read_mtp_presence(f, n_mtp);
    layers_.resize(n_ffn_layers());
}

// the first MTP block is loaded when the file has any tensor of it (then all it needs, shapes checked); a file
// whose MTP blocks were left out has no head, and says so to whoever asks for one
void qwen35_layers::read_mtp_presence(const gguf_file & f, uint32_t n_mtp) {
    const std::string eh_proj = format("blk.%d.nextn.eh_proj.weight", hp_.n_layer);
    if (n_mtp == 0) {
        mtp_missing_ = format("%s: the file has no multi-token-prediction head (%snextn_predict_layers is 0 or "
                              "absent)", f.path().c_str(), prefix_.c_str());
    } else if (f.n_blocks_present() <= hp_.n_layer) {
        mtp_missing_ = format("%s: %snextn_predict_layers = %u but the file has no tensor of MTP block %d (missing "
                              "'%s'; converted without its MTP weights?)", f.path().c_str(), prefix_.c_str(), n_mtp,
                              hp_.n_layer, eh_proj.c_str());
    } else {
        mtp_il_ = hp_.n_layer;
        hp_.recurrent.push_back(false);  // an MTP block is a full-attention layer
    }
}

size_t qwen35_layers::max_graph_nodes(int n_tree_levels, int n_tokens) const {
    const size_t chunks  = (size_t) ((n_tokens + DELTA_NET_CHUNK - 1) / DELTA_NET_CHUNK);
    const size_t chunked = any_chunked_ ? DELTA_NET_CHUNKED_NODES + DELTA_NET_CHUNKED_NODES_PER_CHUNK * chunks : 0;
    return 128 + (128 + DELTA_NET_TREE_NODES_PER_LEVEL * (size_t) n_tree_levels + chunked) * (size_t) hp_.n_layer;
}

// rope.dimension_sections: M-RoPE's four sections
void qwen35_layers::read_mrope_sections(const gguf_file & f, const std::string & a) {
    const std::string &  path     = f.path();
    std::vector<int32_t> sections = f.i32_array(a + "rope.dimension_sections");
    if (sections.size() != GGML_MROPE_SECTIONS) {
        throw format_error(format("%s: key '%srope.dimension_sections' has %zu entries, expected %d",
                                  path.c_str(), a.c_str(), sections.size(), GGML_MROPE_SECTIONS));
    }
    // sections count rotated dim pairs (ggml cycles through them): each >= 0, together 1 .. the head dim
    int64_t section_sum = 0;
    for (int32_t v : sections) {
        section_sum += v;
    }
    if (*std::min_element(sections.begin(), sections.end()) < 0 || section_sum < 1 ||
        section_sum > hp_.att.head_dim) {
        throw format_error(format("%s: key '%srope.dimension_sections' = [%d, %d, %d, %d]: expected entries >= 0 "
                                  "summing to 1..%lld (the head dim)", path.c_str(), a.c_str(), sections[0],
                                  sections[1], sections[2], sections[3], (long long) hp_.att.head_dim));
    }
    std::copy(sections.begin(), sections.end(), hp_.att.rope.sections);
    hp_.att.rope.multi = true;
}

// ssm.*: the gated delta net's sizes
void qwen35_layers::read_delta_net_hparams(const gguf_file & f, const std::string & a) {
    const std::string & path = f.path();
    hp_.d_conv = f.u32_in(a + "ssm.conv_kernel", 2, 64);  // the state keeps d_conv - 1 columns
    hp_.S      = f.u32_in(a + "ssm.state_size", 1, 4096);
    hp_.Hk     = f.u32_in(a + "ssm.group_count", 1, 4096);
    hp_.Hv     = f.u32_in(a + "ssm.time_step_rank", 1, 4096);
    const int64_t d_inner = f.u32(a + "ssm.inner_size");
    if (hp_.Hv % hp_.Hk != 0) {
        throw format_error(format("%s: ssm.time_step_rank = %lld must be a multiple of ssm.group_count = %lld",
                                  path.c_str(), (long long) hp_.Hv, (long long) hp_.Hk));
    }
    if (d_inner != hp_.S * hp_.Hv) {
        throw format_error(format("%s: ssm.inner_size = %lld, expected ssm.state_size * ssm.time_step_rank = %lld",
                                  path.c_str(), (long long) d_inner, (long long) (hp_.S * hp_.Hv)));
    }
}

// which layers are recurrent: the explicit list, else every layer but each interval-th
void qwen35_layers::read_recurrent_layers(const gguf_file & f, const std::string & a, int n_layer_all) {
    if (f.has_key(a + "attention.recurrent_layers")) {
        std::vector<bool> r = f.bool_array(a + "attention.recurrent_layers");
        if ((int) r.size() < hp_.n_layer) {
            throw format_error(format("%s: key '%sattention.recurrent_layers' has %zu entries, expected %d",
                                      f.path().c_str(), a.c_str(), r.size(), n_layer_all));
        }
        hp_.recurrent.assign(r.begin(), r.begin() + hp_.n_layer);
    } else {
        const uint32_t interval = f.u32_in_or(a + "full_attention_interval", 4, 1, 65536);
        for (int il = 0; il < hp_.n_layer; ++il) {
            hp_.recurrent.push_back((il + 1) % interval != 0);
        }
    }
}

void qwen35_layers::declare_layer(weights & w, int il) {
    const int64_t  E = hp_.n_embd, hd = hp_.att.head_dim, S = hp_.S, Hv = hp_.Hv;
    const int64_t  C = 2 * S * hp_.Hk + S * Hv;
    qwen35_layer & l    = layers_[il];
    auto           name = [il](const char * s) { return format("blk.%d.%s", il, s); };
    l.attn_norm           = w.require(name("attn_norm.weight"), {E}, il, WEIGHT_USE_OTHER);
    l.post_attention_norm = w.require(name("post_attention_norm.weight"), {E}, il, WEIGHT_USE_OTHER);
    declare_ffn(w, il);
    if (!hp_.recurrent[il]) {
        l.wq     = w.require(name("attn_q.weight"), {E, 2 * hd * hp_.att.n_head}, il, WEIGHT_USE_MATMUL);
        l.wk     = w.require(name("attn_k.weight"), {E, hd * hp_.att.n_head_kv}, il, WEIGHT_USE_MATMUL);
        l.wv     = w.require(name("attn_v.weight"), {E, hd * hp_.att.n_head_kv}, il, WEIGHT_USE_MATMUL);
        l.wo     = w.require(name("attn_output.weight"), {hd * hp_.att.n_head, E}, il, WEIGHT_USE_MATMUL);
        l.q_norm = w.require(name("attn_q_norm.weight"), {hd}, il, WEIGHT_USE_OTHER);
        l.k_norm = w.require(name("attn_k_norm.weight"), {hd}, il, WEIGHT_USE_OTHER);
        return;
    }
    l.wqkv       = w.require(name("attn_qkv.weight"), {E, C}, il, WEIGHT_USE_MATMUL);
    l.wgate      = w.require(name("attn_gate.weight"), {E, S * Hv}, il, WEIGHT_USE_MATMUL);
    l.ssm_conv1d = w.require(name("ssm_conv1d.weight"), {hp_.d_conv, C}, il, WEIGHT_USE_OTHER);
    l.ssm_dt     = w.require(name("ssm_dt.bias"), {Hv}, il, WEIGHT_USE_OTHER);
    l.ssm_a      = w.require(name("ssm_a"), {Hv}, il, WEIGHT_USE_OTHER);
    l.ssm_beta   = w.require(name("ssm_beta.weight"), {E, Hv}, il, WEIGHT_USE_MATMUL);
    l.ssm_alpha  = w.require(name("ssm_alpha.weight"), {E, Hv}, il, WEIGHT_USE_MATMUL);
    l.ssm_norm   = w.require(name("ssm_norm.weight"), {S}, il, WEIGHT_USE_OTHER);
    l.ssm_out    = w.require(name("ssm_out.weight"), {S * Hv, E}, il, WEIGHT_USE_MATMUL);
    if (l.ssm_conv1d->type != GGML_TYPE_F32) {
        throw format_error(format("%s: tensor '%s' has type %s, expected f32", file_->path().c_str(),
                                  name("ssm_conv1d.weight").c_str(), ggml_type_name(l.ssm_conv1d->type)));
    }
    l.ssm_conv1d_t = w.transposed_copy(name("ssm_conv1d.weight"), il, WEIGHT_USE_OTHER);
}

void qwen35_layers::declare_extra(weights & w) {
    if (mtp_il_ < 0) {
        return;
    }
    declare_layer(w, mtp_il_);
    const int64_t E = hp_.n_embd, V = info_.n_vocab;
    const int     il = mtp_il_;
    auto          name = [il](const char * s) { return format("blk.%d.nextn.%s", il, s); };
    mtp_.eh_proj   = w.require(name("eh_proj.weight"), {2 * E, E}, il, WEIGHT_USE_MATMUL);
    mtp_.enorm     = w.require(name("enorm.weight"), {E}, il, WEIGHT_USE_OTHER);
    mtp_.hnorm     = w.require(name("hnorm.weight"), {E}, il, WEIGHT_USE_OTHER);
    mtp_.embed     = w.optional(name("embed_tokens.weight"), {E, V}, -1, WEIGHT_USE_GET_ROWS);
    mtp_.head      = w.optional(name("shared_head_head.weight"), {E, V}, il, WEIGHT_USE_MATMUL);
    mtp_.head_norm = w.optional(name("shared_head_norm.weight"), {E}, il, WEIGHT_USE_OTHER);
}

// tokens [n], h [E, n] -> h' [E, n] ([E, 1]: last_only): eh_proj [rms(embed) * enorm ‖ rms(h) * hnorm] -> the MTP
// block's layer -> its norm (shared_head_norm, else the final norm), as speculators' MTPLayerMixin and llama.cpp's
// qwen35 MTP graph
ggml_tensor * qwen35_layers::build_mtp(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                       const state_tensors & st, ggml_tensor * h, bool last_only) const {
    if (mtp_il_ < 0) {
        throw unsupported_error(mtp_missing_);
    }
    const float   eps = hp_.att.norm_eps;
    ggml_tensor * e   = ggml_get_rows(ctx, mtp_.embed ? mtp_.embed : token_embedding(), in.tokens);  // [E, n]
    ggml_tensor * x   = ggml_concat(ctx, build_rms_norm(ctx, e, mtp_.enorm, eps),
                                    build_rms_norm(ctx, h, mtp_.hnorm, eps), 0);  // [2E, n]
    x = build_layer(ctx, gf, in, st, mtp_il_, ggml_mul_mat(ctx, mtp_.eh_proj, x), last_only);
    return mtp_.head_norm ? build_rms_norm(ctx, x, mtp_.head_norm, eps) : build_output_norm(ctx, x);
}

// x: [E, n] -> [E, n], or [E, 1] for the last token only
ggml_tensor * qwen35_layers::build_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                         const state_tensors & st, int il, ggml_tensor * x,
                                         bool last_token_only) const {
    const qwen35_layer & l   = layers_[il];
    const float          eps = hp_.att.norm_eps;
    auto mixer = [&](ggml_tensor * cur) {
        return hp_.recurrent[il] ? build_gdn_layer(ctx, gf, in, st, l, il, cur, last_token_only)
                                 : build_attention_layer(ctx, gf, in, st, l, il, cur, last_token_only);
    };
    x = build_mixer_residual(ctx, x, l.attn_norm, eps, last_token_only, mixer, "attn_residual", il);
    return build_ffn_residual(ctx, x, l.post_attention_norm, eps,
                              [&](ggml_tensor * cur) { return build_ffn(ctx, gf, il, cur); }, il);
}

// x: [E, n] -> [E, n], or [E, 1] for the last token only (the state still takes all n). The projections, the
// SiLU and the norms run over every row; the conv and the delta rule over each session's rows, or over all
// sessions' at once where they are chains of one length (models/delta_net_batch.h).
ggml_tensor * qwen35_layers::build_gdn_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                             const state_tensors & st, const qwen35_layer & l, int il,
                                             ggml_tensor * x, bool last_token_only) const {
    const int64_t n = x->ne[1], S = hp_.S, Hk = hp_.Hk, Hv = hp_.Hv;
    const float   eps = hp_.att.norm_eps;

    ggml_tensor * qkv  = ggml_mul_mat(ctx, l.wqkv, x);   // [C, n]
    ggml_tensor * z    = ggml_mul_mat(ctx, l.wgate, x);  // [S*Hv, n]
    ggml_tensor * beta = ggml_sigmoid(ctx, ggml_mul_mat(ctx, l.ssm_beta, x));  // [Hv, n]
    // g = softplus(alpha + dt) * a: the log-decay, negative
    ggml_tensor * g = ggml_mul(ctx, ggml_softplus(ctx, ggml_add(ctx, ggml_mul_mat(ctx, l.ssm_alpha, x), l.ssm_dt)),
                               l.ssm_a);  // [Hv, n]
    beta = ggml_reshape_4d(ctx, beta, 1, Hv, n, 1);
    g    = ggml_reshape_4d(ctx, g, 1, Hv, n, 1);

    const std::vector<sequence_part> parts = sequence_parts(in, st);
    const bool together = chains_of_one_length(parts) && !chunked_form(il, *parts[0].recurrent, parts[0].n);
    std::vector<ggml_tensor *> convs;
    if (!together) {
        for (const sequence_part & p : parts) {
            ggml_tensor * rows = token_range(ctx, qkv, 1, p.first, p.n);
            convs.push_back(p.recurrent->tree_levels.empty()
                                ? build_conv_chain(ctx, gf, *p.recurrent, *p.st, il, rows, l.ssm_conv1d)
                                : build_conv_tree(ctx, gf, *p.recurrent, *p.st, il, rows, l.ssm_conv1d_t));
        }
    }
    ggml_tensor * conv = ggml_silu(ctx, together ? build_conv_chains(ctx, gf, parts, il, qkv, l.ssm_conv1d)
                                                 : join_tokens(ctx, convs, 1));  // [C, n]
    const size_t  f = ggml_element_size(conv);
    ggml_tensor * q = build_l2_norm(ctx, ggml_view_3d(ctx, conv, S, Hk, n, S * f, conv->nb[1], 0), eps);
    ggml_tensor * k = build_l2_norm(ctx, ggml_view_3d(ctx, conv, S, Hk, n, S * f, conv->nb[1], S * Hk * f), eps);
    ggml_tensor * v = ggml_view_3d(ctx, conv, S, Hv, n, S * f, conv->nb[1], 2 * S * Hk * f);

    std::vector<ggml_tensor *> outs;
    if (together) {
        outs.push_back(build_gated_delta_net_chains(ctx, gf, parts, il, q, k, v, g, beta));
    } else {
        for (const sequence_part & p : parts) {
            auto rows = [&](ggml_tensor * t) { return token_range(ctx, t, 2, p.first, p.n); };
            outs.push_back(build_delta_rule(ctx, gf, *p.recurrent, *p.st, il, rows(q), rows(k), rows(v), rows(g),
                                            rows(beta)));
        }
    }
    ggml_tensor * o = join_tokens(ctx, outs, 2);  // [S, Hv, n]
    // gated RMSNorm per head: rms(o) * ssm_norm * silu(z)
    o = ggml_mul(ctx, build_rms_norm(ctx, o, l.ssm_norm, eps), ggml_silu(ctx, ggml_reshape_3d(ctx, z, S, Hv, n)));
    ggml_format_name(o, "gdn_out-%d", il);
    if (last_token_only) {
        o = last_token(ctx, o);
    }
    return ggml_mul_mat(ctx, l.ssm_out, ggml_reshape_2d(ctx, o, S * Hv, o->ne[2]));
}

// whether a chain of n tokens at layer il runs the chunked form of the delta rule: a micro-batch committed
// whole (no steps kept) of at least a chunk, where that form is chosen
bool qwen35_layers::chunked_form(int il, const recurrent_inputs & rin, int64_t n) const {
    return rin.tree_levels.empty() && chunked_[il] && !rin.keep_steps && n >= DELTA_NET_CHUNK;
}

// one session's rows: q, k [S, Hk, n], v [S, Hv, n], g, beta [1, Hv, n] -> the delta rule's output [S, Hv, n]
// from its state (rin, st). A tree evaluation (rin.tree_levels) runs it along parent links.
ggml_tensor * qwen35_layers::build_delta_rule(ggml_context * ctx, ggml_cgraph * gf, const recurrent_inputs & rin,
                                              const state_tensors & st, int il, ggml_tensor * q, ggml_tensor * k,
                                              ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta) const {
    return !rin.tree_levels.empty()       ? build_gated_delta_net_tree(ctx, gf, rin, st, il, q, k, v, g, beta)
           : chunked_form(il, rin, v->ne[2]) ? build_gated_delta_net_chunked(ctx, gf, rin, st, il, q, k, v, g, beta)
                                             : build_gated_delta_net(ctx, gf, rin, st, il, q, k, v, g, beta);
}

// x: [E, n] -> [E, n], or [E, 1] for the last token only (K/V still written for all n)
ggml_tensor * qwen35_layers::build_attention_layer(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                                   const state_tensors & st, const qwen35_layer & l, int il,
                                                   ggml_tensor * x, bool last_token_only) const {
    const int64_t n = x->ne[1], hd = hp_.att.head_dim, H = hp_.att.n_head, Hkv = hp_.att.n_head_kv;
    ggml_tensor * qg = ggml_mul_mat(ctx, l.wq, x);  // [2*hd*H, n]: per head [q | gate]
    const size_t  f  = ggml_element_size(qg);
    ggml_tensor * q    = ggml_view_3d(ctx, qg, hd, H, n, 2 * hd * f, qg->nb[1], 0);
    ggml_tensor * gate = ggml_cont_2d(ctx, ggml_view_3d(ctx, qg, hd, H, n, 2 * hd * f, qg->nb[1], hd * f), hd * H, n);
    ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, x), hd, Hkv, n);
    ggml_tensor * v = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wv, x), hd, Hkv, n);
    build_qk_norm_rope(ctx, q, k, l.q_norm, l.k_norm, hp_.att.norm_eps, in.positions, hp_.att.rope);
    // the projections above ran for all n even for the last token only: M-RoPE positions are section-major
    ggml_tensor * cur = build_batch_attention(ctx, gf, in, st, il, q, k, v, 1.0f / std::sqrt((float) hd),
                                              last_token_only);
    if (last_token_only) {
        gate = last_token(ctx, gate);
    }
    cur = ggml_mul(ctx, cur, ggml_sigmoid(ctx, gate));
    return ggml_mul_mat(ctx, l.wo, cur);
}

// per layer: whether prefill micro-batches use the chunked delta rule (model.h, delta_net_form)
void qwen35_layers::choose_delta_net_form(delta_net_form form) {
    chunked_.assign(hp_.n_layer, form == delta_net_form::chunked);
    if (form == delta_net_form::automatic) {
        // a probe op of this model's shapes, asked of each device holding recurrent layers
        ggml_init_params params = {ggml_tensor_overhead() * 8, nullptr, true};
        ggml_context *   ctx    = ggml_init(params);
        const int64_t    S = hp_.S, n = 2;
        ggml_tensor * probe = ggml_gated_delta_net(
            ctx, ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, hp_.Hk, n, 1),
            ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, hp_.Hk, n, 1),
            ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, hp_.Hv, n, 1),
            ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, hp_.Hv, n, 1),
            ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, hp_.Hv, n, 1),
            ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, S, hp_.Hv, 1), 1);
        const backends & be = devices();
        // a plan without the GPU it places layers on assumes the fused op (CUDA, HIP and Metal have it)
        const bool cpu_fused = ggml_backend_dev_supports_op(be.cpu_device(), probe);
        for (int il = 0; il < hp_.n_layer; ++il) {
            ggml_backend_dev_t gpu = be.on_gpu(il) ? be.device_of(il) : nullptr;
            chunked_[il] = !(be.on_gpu(il) ? (!gpu || ggml_backend_dev_supports_op(gpu, probe)) : cpu_fused);
        }
        ggml_free(ctx);
    }
    any_chunked_ = false;
    for (int il = 0; il < hp_.n_layer; ++il) {
        any_chunked_ = any_chunked_ || (hp_.recurrent[il] && chunked_[il]);
    }
}

// the dense target: a SwiGLU FFN of width `feed_forward_length`
class qwen35_model : public qwen35_layers {
  public:
    explicit qwen35_model(std::unique_ptr<gguf_file> file) : qwen35_layers(std::move(file), "qwen35") {
        n_ff_ = file_->u32_in(key_prefix() + "feed_forward_length", 1, 1 << 24);
        ffn_.resize(n_ffn_layers());
    }

  private:
    void declare_ffn(weights & w, int il) override { ffn_[il] = declare_swiglu(w, hparams().n_embd, n_ff_, il); }

    // cur: [E, n] -> [E, n]
    ggml_tensor * build_ffn(ggml_context * ctx, ggml_cgraph *, int il, ggml_tensor * cur) const override {
        return build_swiglu_ffn(ctx, cur, ffn_[il].gate, ffn_[il].up, ffn_[il].down);
    }

    int64_t                     n_ff_ = 0;
    std::vector<swiglu_weights> ffn_;
};

std::unique_ptr<target_model> open_qwen35(std::unique_ptr<gguf_file> file) {
    return std::make_unique<qwen35_model>(std::move(file));
}

}  // namespace pdf
