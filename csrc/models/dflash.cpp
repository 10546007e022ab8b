// DFlash drafter graph (see dflash.h). Legend: E = n_embd, n_ext = captured target layers, m = new context
// rows, B = block length, hd = head dim, H / Hkv = query / KV heads.
#include "models/dflash.h"
#include "core/error.h"
#include "models/blocks.h"
#include "models/sequences.h"

#include <cmath>

namespace pdf {

static const std::string A = "dflash.";  // the prefix of every key below

dflash_draft::dflash_draft(const std::string & path, std::shared_ptr<const target_model> target,
                           const load_progress & progress)
    : loaded_model(std::make_unique<gguf_file>(path, target->devices().plan_only())), target_(std::move(target)) {
    const std::string arch = file_->arch();
    if (arch != "dflash") {
        throw unsupported_error(format("%s: general.architecture = '%s', expected 'dflash' for a draft model",
                                       path.c_str(), arch.c_str()));
    }
    // every hyper-parameter is checked here, against its range, the tensors present (their shapes are checked as
    // they are declared) and the target, before any of it sizes an allocation or reaches a ggml op
    const gguf_file & f       = *file_;
    const int64_t     E       = f.u32_in(A + "embedding_length", 1, 1 << 20);
    const int         n_layer = f.block_count(A + "block_count");
    n_ff_       = f.u32_in(A + "feed_forward_length", 1, 1 << 24);
    att_        = load_attention_hparams(f, A, E);
    // a round drafts block_size - 1 tokens; trained drafters use 8 to 16
    block_size_ = (int) f.u32_in_or(A + "block_size", 16, 2, MAX_BLOCK_SIZE);
    causal_     = f.boolean_or(A + "attention.causal", false);
    if (!f.has_key("tokenizer.ggml.mask_token_id")) {
        throw format_error(format("%s: missing required key 'tokenizer.ggml.mask_token_id' (the DFlash MASK token)",
                                  path.c_str()));
    }
    mask_token_ = (int32_t) f.u32("tokenizer.ggml.mask_token_id");
    check_pair(E);
    check_rope_sections();
    read_sliding_window(n_layer);
    dflash2_ = read_dflash2_hparams(f, E);
    check_variant();

    info_.arch        = "dflash";
    info_.path        = path;
    info_.n_vocab     = target_->info().n_vocab;
    info_.n_embd      = E;
    info_.n_layer     = n_layer;
    info_.n_ctx_train = f.u32_or(A + "context_length", 0);
    for (int il = 0; il < n_layer; ++il) {
        info_.kv_layers.push_back(kv_layer_of(att_, il));
    }
    // the draft's layers live with the target's last layers (same device when offloaded); its devices are the
    // target's, which the weights keep alive
    read_weights(std::shared_ptr<backends>(target_, &target_->devices()), progress);
}

dflash_draft::~dflash_draft() = default;

void dflash_draft::realize(const load_progress & progress) {
    if (target_->devices().plan_only()) {
        throw std::invalid_argument(format("%s: its target %s is still a plan's model (realize the target first)",
                                           file_->path().c_str(), target_->info().path.c_str()));
    }
    file_->require_data();
    realize_weights(progress);
}

void dflash_draft::check_pair(int64_t E) {
    // the pair must fit together: each mismatch names the field and both values
    const model_info &  t    = target_->info();
    const std::string & path = file_->path();
    if (E != t.n_embd) {
        throw format_error(format("%s: dflash.embedding_length = %lld but the target's (%s) hidden size is %lld",
                                  path.c_str(), (long long) E, t.path.c_str(), (long long) t.n_embd));
    }
    if (mask_token_ < 0 || mask_token_ >= t.n_vocab) {
        throw format_error(format("%s: tokenizer.ggml.mask_token_id = %d is outside the target's vocabulary [0, %lld)",
                                  path.c_str(), mask_token_, (long long) t.n_vocab));
    }
    std::vector<int32_t> layers = file_->i32_array(A + "target_layers");
    if (layers.empty()) {
        throw format_error(format("%s: dflash.target_layers is empty", path.c_str()));
    }
    for (size_t i = 0; i < layers.size(); ++i) {
        // layer inputs 1..n_layer exist (n_layer = the last layer's output)
        if (layers[i] < 1 || layers[i] > t.n_layer) {
            throw format_error(format("%s: dflash.target_layers[%zu] = %d is outside the target's layers [1, %d]",
                                      path.c_str(), i, layers[i], t.n_layer));
        }
        capture_layers_.push_back(layers[i]);
    }
}

void dflash_draft::check_rope_sections() const {
    const gguf_file &          f    = *file_;
    const std::string &        path = f.path();
    const std::vector<int32_t> sections =
        f.has_key(A + "rope.dimension_sections") ? f.i32_array(A + "rope.dimension_sections") : std::vector<int32_t>{};
    if (!sections.empty() && (sections[0] < 0 || sections[0] > att_.head_dim)) {
        throw format_error(format("%s: dflash.rope.dimension_sections[0] = %d, expected 0..%lld (the head dim)",
                                  path.c_str(), sections[0], (long long) att_.head_dim));
    }
    for (size_t i = 1; i < sections.size(); ++i) {
        // [head_dim/2, 0, 0, 0] is how M-RoPE targets' drafts say "plain RoPE on the token position"
        if (sections[i] != 0) {
            throw unsupported_error(format("%s: dflash.rope.dimension_sections[%zu] = %d: only temporal (text) M-RoPE "
                                           "sections are supported", path.c_str(), i, sections[i]));
        }
    }
}

void dflash_draft::read_sliding_window(int n_layer) {
    const gguf_file &   f    = *file_;
    const std::string & path = f.path();
    if (!f.has_key(A + "attention.sliding_window")) {
        return;
    }
    swa_window_ = (int) f.u32_in(A + "attention.sliding_window", 1, 1u << 24);
    // llama.cpp requires the per-layer pattern with the window (src/models/dflash.cpp); so do we
    if (!f.has_key(A + "attention.sliding_window_pattern")) {
        throw format_error(format("%s: dflash.attention.sliding_window is set but "
                                  "dflash.attention.sliding_window_pattern (one bool per layer) is missing",
                                  path.c_str()));
    }
    swa_layers_ = f.bool_array(A + "attention.sliding_window_pattern");
    if ((int) swa_layers_.size() != n_layer) {
        throw format_error(format("%s: dflash.attention.sliding_window_pattern has %zu entries, expected %d (one "
                                  "per layer)", path.c_str(), swa_layers_.size(), n_layer));
    }
    swa_causal_ = f.boolean_or(A + "attention.causal", true);
}

void dflash_draft::check_variant() const {
    const gguf_file &   f    = *file_;
    const std::string & path = f.path();
    if (f.has_key(A + "hidden_activation") && f.str(A + "hidden_activation") != "silu") {
        throw unsupported_error(format("%s: dflash.hidden_activation = '%s', only 'silu' is supported", path.c_str(),
                                       f.str(A + "hidden_activation").c_str()));
    }
    if (f.find_tensor("selector_hidden.weight") && !dflash2_.present()) {
        throw format_error(format("%s: tensor 'selector_hidden.weight' is a DFlash2 selector's, but the file has no "
                                  "dflash.conv_kernel_size / conv_group_size / selector_rank / selector_top_k",
                                  path.c_str()));
    }
    for (const char * name : {"markov_w1.weight", "d2t", "token_embd.weight", "output.weight"}) {
        if (f.find_tensor(name)) {
            throw unsupported_error(format("%s: tensor '%s' belongs to a draft variant pydflash does not run (DSpark, "
                                           "reduced vocabulary or a draft-owned embedding/head)",
                                           path.c_str(), name));
        }
    }
}

void dflash_draft::declare_weights(weights & w) {
    const int     place = target_->info().n_layer;
    const int64_t E = info_.n_embd, n_ext = (int64_t) capture_layers_.size();
    const int64_t hd = att_.head_dim, n_head = att_.n_head, n_head_kv = att_.n_head_kv;
    fc_          = w.require("fc.weight", {n_ext * E, E}, place, WEIGHT_USE_MATMUL);
    hidden_norm_ = w.require("enc.output_norm.weight", {E}, place, WEIGHT_USE_OTHER);
    output_norm_ = w.require("output_norm.weight", {E}, place, WEIGHT_USE_OTHER);
    layers_.resize(info_.n_layer);
    for (int il = 0; il < info_.n_layer; ++il) {
        layer & l = layers_[il];
        auto name = [il](const char * s) { return format("blk.%d.%s", il, s); };
        l.attn_norm = w.require(name("attn_norm.weight"), {E}, place, WEIGHT_USE_OTHER);
        l.wq        = w.require(name("attn_q.weight"), {E, hd * n_head}, place, WEIGHT_USE_MATMUL);
        l.wk        = w.require(name("attn_k.weight"), {E, hd * n_head_kv}, place, WEIGHT_USE_MATMUL);
        l.wv        = w.require(name("attn_v.weight"), {E, hd * n_head_kv}, place, WEIGHT_USE_MATMUL);
        l.wo        = w.require(name("attn_output.weight"), {hd * n_head, E}, place, WEIGHT_USE_MATMUL);
        l.q_norm    = w.require(name("attn_q_norm.weight"), {hd}, place, WEIGHT_USE_OTHER);
        l.k_norm    = w.require(name("attn_k_norm.weight"), {hd}, place, WEIGHT_USE_OTHER);
        l.ffn_norm  = w.require(name("ffn_norm.weight"), {E}, place, WEIGHT_USE_OTHER);
        l.ffn_gate  = w.require(name("ffn_gate.weight"), {E, n_ff_}, place, WEIGHT_USE_MATMUL);
        l.ffn_up    = w.require(name("ffn_up.weight"), {E, n_ff_}, place, WEIGHT_USE_MATMUL);
        l.ffn_down  = w.require(name("ffn_down.weight"), {n_ff_, E}, place, WEIGHT_USE_MATMUL);
        if (dflash2_.present()) {
            const int64_t K = dflash2_.kernel, proj = 2 * K * (E / dflash2_.group);
            l.attn_conv = {w.require(name("attn_conv_base"), {E, K, 2}, place, WEIGHT_USE_OTHER),
                           w.require(name("attn_conv_proj.weight"), {E, proj}, place, WEIGHT_USE_MATMUL)};
            l.ffn_conv  = {w.require(name("ffn_conv_base"), {E, K, 2}, place, WEIGHT_USE_OTHER),
                           w.require(name("ffn_conv_proj.weight"), {E, proj}, place, WEIGHT_USE_MATMUL)};
        }
    }
    if (dflash2_.present()) {
        const int64_t R = dflash2_.rank, V = target_->info().n_vocab;
        // the codebooks are looked up by token (rows), like an embedding
        selector_ = {w.require("selector_predecessor.weight", {R, V}, place, WEIGHT_USE_OTHER),
                     w.require("selector_successor.weight", {R, V}, place, WEIGHT_USE_OTHER),
                     w.require("selector_hidden.weight", {E, R}, place, WEIGHT_USE_MATMUL)};
    }
}

template <class F>
ggml_tensor * dflash_draft::around(ggml_context * ctx, const dflash2_conv & conv, ggml_tensor * x, int64_t S,
                                   F sublayer) const {
    if (!dflash2_.present()) {
        return sublayer(x);
    }
    // [.., S*B] as [.., B, S]: each session's block convolved on its own rows
    const int64_t N = x->ne[1], B = N / S;
    auto blocks = [&](ggml_tensor * t) { return S == 1 ? t : ggml_reshape_3d(ctx, t, t->ne[0], B, S); };
    auto rows   = [&](ggml_tensor * t) { return S == 1 ? t : ggml_reshape_2d(ctx, t, t->ne[0], N); };
    ggml_tensor * dyn = blocks(ggml_mul_mat(ctx, conv.proj, x));  // [2*K*G, B(, S)]: both sides' coefficients
    ggml_tensor * in  = rows(build_dflash2_conv(ctx, blocks(x), dyn, conv, 0, dflash2_));
    return rows(build_dflash2_conv(ctx, blocks(sublayer(in)), dyn, conv, 1, dflash2_));
}

// ctx_feats: [n_ext*E, S*m] -> each session's context K/V rows in its draft cache
void dflash_draft::build_context(ggml_context * ctx, ggml_cgraph * gf, const draft_inputs & in,
                                 const std::vector<draft_sequence> & seqs) const {
    const int64_t hd = att_.head_dim, Hkv = att_.n_head_kv, m = in.n_ctx_rows, M = m * (int64_t) seqs.size();
    const float   eps = att_.norm_eps;
    ggml_tensor * c = build_rms_norm(ctx, ggml_mul_mat(ctx, fc_, in.ctx_feats), hidden_norm_, eps);  // [E, M]
    for (int il = 0; il < info_.n_layer; ++il) {
        const layer & l = layers_[il];
        ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, c), hd, Hkv, M);
        k = ggml_reshape_2d(ctx, build_rope(ctx, build_rms_norm(ctx, k, l.k_norm, eps), in.ctx_pos, att_.rope),
                            hd * Hkv, M);
        ggml_tensor * v = ggml_mul_mat(ctx, l.wv, c);  // [hd*Hkv, M]
        for (const draft_sequence & q : seqs) {
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, q.st.k[il], token_range(ctx, k, 1, q.ctx_first, m),
                                                        q.ctx_slots));
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, q.st.v[il], token_range(ctx, v, 1, q.ctx_first, m),
                                                        q.ctx_slots));
        }
    }
}

// each session's block rows but its first (the anchor): [.., S*B] -> [.., S*(B-1)]
static ggml_tensor * drop_anchors(ggml_context * ctx, ggml_tensor * x, const std::vector<draft_sequence> & seqs,
                                  int64_t B) {
    std::vector<ggml_tensor *> rows;
    for (const draft_sequence & q : seqs) {
        rows.push_back(seqs.size() == 1 ? ggml_view_2d(ctx, x, x->ne[0], B - 1, x->nb[1], x->nb[1])
                                        : token_range(ctx, x, 1, q.first + 1, B - 1));
    }
    return join_tokens(ctx, rows, 1);
}

// ctx_feats: [n_ext*E, S*m] -> context K/V rows in the draft caches; each block [anchor, MASK x (B-1)] ->
// [E, S*(B-1)]
ggml_tensor * dflash_draft::build(ggml_context * ctx, ggml_cgraph * gf, const draft_inputs & in,
                                  const state_tensors & st) const {
    const int64_t hd = att_.head_dim, H = att_.n_head, Hkv = att_.n_head_kv;
    const float   eps = att_.norm_eps;
    std::vector<draft_sequence> seqs = in.sequences;
    if (seqs.empty()) {
        seqs.push_back({0, 0, in.ctx_slots, in.slots, in.kq_mask, in.kq_mask_swa, in.n_kv, st});
    }
    // context rows: fused features -> per layer K (k_norm, RoPE at their positions) and V, written once
    if (in.n_ctx_rows > 0) {
        build_context(ctx, gf, in, seqs);
    }
    if (in.n_block == 0) {
        return nullptr;
    }

    // the blocks: [anchor, MASK x (B-1)] through the draft layers, each attending over its context + block K/V
    const int64_t B = in.n_block, S = (int64_t) seqs.size(), N = B * S;
    ggml_tensor * h = ggml_get_rows(ctx, target_->token_embedding(), in.tokens);  // [E, N]
    for (int il = 0; il < info_.n_layer; ++il) {
        const layer & l = layers_[il];
        // past the last attention only the B-1 proposal rows matter (row 0 is the anchor, already known); DFlash2's
        // convolutions mix rows, so it keeps them all
        const bool    cut = il == info_.n_layer - 1 && !dflash2_.present();
        auto attention = [&](ggml_tensor * hn) {
            ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wq, hn), hd, H, N);
            ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, hn), hd, Hkv, N);
            ggml_tensor * v = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wv, hn), hd, Hkv, N);
            build_qk_norm_rope(ctx, q, k, l.q_norm, l.k_norm, eps, in.pos, att_.rope);
            std::vector<ggml_tensor *> outs;
            for (const draft_sequence & sq : seqs) {
                // the block's K/V go to the cache slots after the context; the next round overwrites them
                const kv_inputs att{sq.slots, is_swa(il) ? sq.kq_mask_swa : sq.kq_mask, sq.n_kv};
                outs.push_back(build_kv_attention(ctx, gf, att, sq.st, il, token_range(ctx, q, 2, sq.first, B),
                                                  token_range(ctx, k, 2, sq.first, B),
                                                  token_range(ctx, v, 2, sq.first, B),
                                                  1.0f / std::sqrt((float) hd)));  // [hd*H, B]
            }
            ggml_tensor * o = join_tokens(ctx, outs, 1);
            return ggml_mul_mat(ctx, l.wo, cut ? drop_anchors(ctx, o, seqs, B) : o);
        };
        ggml_tensor * a = around(ctx, l.attn_conv, build_rms_norm(ctx, h, l.attn_norm, eps), S, attention);
        h = ggml_add(ctx, a, cut ? drop_anchors(ctx, h, seqs, B) : h);
        auto ffn = [&](ggml_tensor * hn) { return build_swiglu_ffn(ctx, hn, l.ffn_gate, l.ffn_up, l.ffn_down); };
        h = ggml_add(ctx, around(ctx, l.ffn_conv, build_rms_norm(ctx, h, l.ffn_norm, eps), S, ffn), h);
    }
    if (dflash2_.present()) {
        h = drop_anchors(ctx, h, seqs, B);
    }
    return build_rms_norm(ctx, h, output_norm_, eps);  // [E, S*(B-1)]: the target's head turns it into proposals
}

}  // namespace pdf
