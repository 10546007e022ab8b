// The DFlash block-diffusion drafter (GGUF arch `dflash`, llama.cpp-compatible). It owns neither embedding
// nor LM head: both are the target's. It reads the target's hidden states at `capture_layers()` (layer
// inputs, = HF target_layer_ids + 1), fuses them per token (fc -> hidden_norm) into extra K/V entries of
// every draft layer, kept in a draft-side KV cache, and in ONE forward over [anchor, MASK x (B-1)] proposes
// the tokens at positions start+1 .. start+B-1 (same-position prediction).
#pragma once

#include "models/attention.h"
#include "models/dflash2.h"
#include "models/model.h"

namespace pdf {

// one drafting session's share of a draft graph over several (state/draft_batch.h): its n_ctx_rows context rows
// from row ctx_first of the graph's, its n_block block rows from row first, and its own cache and masks
struct draft_sequence {
    int64_t       ctx_first   = 0;
    int64_t       first       = 0;
    ggml_tensor * ctx_slots   = nullptr;  // I64 [n_ctx_rows]
    ggml_tensor * slots       = nullptr;  // I64 [n_block]
    ggml_tensor * kq_mask     = nullptr;  // F16 [n_kv, n_block]
    ggml_tensor * kq_mask_swa = nullptr;
    int           n_kv        = 0;
    state_tensors st;
};

// inputs of one draft graph, set by the drafter session
//   ctx_feats: F32 [n_ext*E, n_ctx_rows]  target features of newly committed tokens (may be 0 rows)
//   ctx_pos, ctx_slots: I32 / I64 [n_ctx_rows]
//   tokens: I32 [B] block tokens (anchor, masks); pos: I32 [B]; slots: I64 [B]
//   kq_mask: F16 [n_kv, B]; kq_mask_swa: the same for sliding-window layers (nullptr without any)
//   sequences: several sessions' (S) drafts in one graph: ctx_feats, ctx_pos, tokens and pos hold S x the rows
//   above, session after session, and each session's slots, masks and cache are in its sequence
struct draft_inputs {
    ggml_tensor * ctx_feats = nullptr;
    ggml_tensor * ctx_pos   = nullptr;
    ggml_tensor * ctx_slots = nullptr;
    ggml_tensor * tokens    = nullptr;
    ggml_tensor * pos       = nullptr;
    ggml_tensor * slots     = nullptr;
    ggml_tensor * kq_mask   = nullptr;
    ggml_tensor * kq_mask_swa = nullptr;
    int           n_ctx_rows = 0;  // (per session)
    int           n_block    = 0;  // 0: only append context rows (per session)
    int           n_kv       = 0;
    std::vector<draft_sequence> sequences;  // empty: one session's (the slots and masks above, the cache st)
};

class dflash_draft final : public loaded_model {
  public:
    // the largest dflash.block_size accepted (drafts are trained with 8 to 16)
    static constexpr int MAX_BLOCK_SIZE = 256;

    // loads `path` and checks it against `target` (typed errors naming each mismatched field)
    dflash_draft(const std::string & path, std::shared_ptr<const target_model> target,
                 const load_progress & progress = {});
    ~dflash_draft();
    // a memory plan's drafter becomes a load's, after its target did (target_model::realize)
    void realize(const load_progress & progress = {});

    // info().kv_layers: the draft layers
    const target_model &     target() const { return *target_; }
    const std::vector<int> & capture_layers() const { return capture_layers_; }
    int                      block_size() const { return block_size_; }
    int32_t                  mask_token() const { return mask_token_; }
    bool                     causal() const { return causal_; }
    // Sliding-window layers (dflash.attention.sliding_window + sliding_window_pattern): a query at position q
    // sees keys at q - window < p, and (swa_causal) none after itself, as z-lab's drafter trains them: its
    // sliding layers are causal unless the config says is_causal (here: dflash.attention.causal, when present)
    int                      swa_window() const { return swa_window_; }  // 0: no sliding-window layer
    bool                     is_swa(int il) const { return swa_window_ > 0 && swa_layers_[il]; }
    bool                     swa_causal() const { return swa_causal_; }
    size_t                   max_graph_nodes() const { return 128 + (64 + 48 * dflash2_.kernel) * (size_t) info_.n_layer; }
    // DFlash2 (models/dflash2.h): its sizes (none for a DFlash drafter) and its candidate selector
    const dflash2_hparams &  dflash2() const { return dflash2_; }
    const dflash2_selector & selector() const { return selector_; }

    // appends context K/V rows (into the draft cache st.k / st.v); when in.n_block > 0 also runs the block and
    // returns the final normed hidden states of its proposal rows 1..B-1: [E, B-1], for the target's head (with
    // in.sequences: [E, S*(B-1)], each session's rows in turn, st unused)
    ggml_tensor * build(ggml_context * ctx, ggml_cgraph * gf, const draft_inputs & in, const state_tensors & st) const;

  private:
    // the checks that need the target: hidden size, MASK token, target_layers (-> capture_layers_)
    void check_pair(int64_t n_embd);
    void check_rope_sections() const;
    void read_sliding_window(int n_layer);
    // hidden activation, and tensors of draft variants this drafter is not
    void check_variant() const;
    void declare_weights(weights & w) override;

    struct layer {
        ggml_tensor * attn_norm, * wq, * wk, * wv, * wo, * q_norm, * k_norm;
        ggml_tensor * ffn_norm, * ffn_gate, * ffn_up, * ffn_down;
        dflash2_conv  attn_conv, ffn_conv;  // DFlash2 only
    };
    // DFlash2: `sublayer` of the normed x between the side-0 and side-1 convolutions (DFlash: sublayer(x))
    template <class F>
    ggml_tensor * around(ggml_context * ctx, const dflash2_conv & conv, ggml_tensor * x, int64_t S, F sublayer) const;
    // the context rows' K/V written into each session's cache
    void          build_context(ggml_context * ctx, ggml_cgraph * gf, const draft_inputs & in,
                                const std::vector<draft_sequence> & seqs) const;

    std::shared_ptr<const target_model> target_;
    std::vector<int>                    capture_layers_;
    int                                 block_size_ = 16;
    int32_t                             mask_token_ = -1;
    bool                                causal_     = false;
    int                                 swa_window_ = 0;
    std::vector<bool>                   swa_layers_;
    bool                                swa_causal_ = true;
    attention_hparams                   att_;
    int64_t                             n_ff_ = 0;
    dflash2_hparams                     dflash2_;
    dflash2_selector                    selector_;
    ggml_tensor *                       fc_ = nullptr, * hidden_norm_ = nullptr, * output_norm_ = nullptr;
    std::vector<layer>                  layers_;
};

}  // namespace pdf
