// Qwen3 MoE target (GGUF arch `qwen3moe`: Qwen3-30B-A3B, Qwen3-235B-A22B; llama.cpp-compatible): the Qwen3 layer
// (models/qwen3.h) with a mixture of experts (models/moe.h) for its FFN.
#include "core/error.h"
#include "models/moe.h"
#include "models/qwen3.h"

namespace pdf {

class qwen3moe_model : public qwen3_layers {
  public:
    explicit qwen3moe_model(std::unique_ptr<gguf_file> file) : qwen3_layers(std::move(file), "qwen3moe") {
        moe_ = load_moe_hparams(*file_, key_prefix(), info_.n_layer, /*shared_expert=*/false);
        // llama.cpp's qwen3moe always renormalises the top-k probabilities (it reads no key for it): the released
        // checkpoints set norm_topk_prob, and pydflash-convert refuses those that do not
        moe_.renormalise = true;
        ffn_.resize(info_.n_layer);
    }

    size_t max_graph_nodes(int n_tree_levels, int n_tokens) const override {
        return target_model::max_graph_nodes(n_tree_levels, n_tokens) + moe_graph_nodes(moe_) * info_.n_layer;
    }

  private:
    void declare_ffn(weights & w, int il) override { ffn_[il] = declare_moe_layer(w, moe_, n_embd(), il); }

    // cur: [E, n] -> [E, n]
    ggml_tensor * build_ffn(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * cur) const override {
        return build_moe_ffn(ctx, gf, ffn_[il], moe_, cur, il);
    }

    moe_hparams            moe_;
    std::vector<moe_layer> ffn_;
};

std::unique_ptr<target_model> open_qwen3moe(std::unique_ptr<gguf_file> file) {
    return std::make_unique<qwen3moe_model>(std::move(file));
}

}  // namespace pdf
