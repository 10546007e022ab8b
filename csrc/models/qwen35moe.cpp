// Qwen3.5 MoE target (GGUF arch `qwen35moe`: Qwen3.5/3.6-35B-A3B, Qwen3.5-122B-A10B; llama.cpp-compatible): the
// Qwen3.5 hybrid layer (models/qwen35.h) with a mixture of experts and a gated shared expert (models/moe.h) for its
// FFN.
#include "core/error.h"
#include "models/moe.h"
#include "models/qwen35.h"

namespace pdf {

class qwen35moe_model : public qwen35_layers {
  public:
    explicit qwen35moe_model(std::unique_ptr<gguf_file> file) : qwen35_layers(std::move(file), "qwen35moe") {
        moe_ = load_moe_hparams(*file_, key_prefix(), hparams().n_layer_all, /*shared_expert=*/true);
        // llama.cpp's qwen35moe always renormalises the top-k probabilities, as Qwen3.5-MoE does
        moe_.renormalise = true;
        ffn_.resize(n_ffn_layers());
    }

    size_t max_graph_nodes(int n_tree_levels, int n_tokens) const override {
        return qwen35_layers::max_graph_nodes(n_tree_levels, n_tokens) + moe_graph_nodes(moe_) * info_.n_layer;
    }
    size_t mtp_graph_nodes() const override { return qwen35_layers::mtp_graph_nodes() + moe_graph_nodes(moe_); }

  private:
    void declare_ffn(weights & w, int il) override { ffn_[il] = declare_moe_layer(w, moe_, hparams().n_embd, il); }

    // cur: [E, n] -> [E, n]
    ggml_tensor * build_ffn(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * cur) const override {
        return build_moe_ffn(ctx, gf, ffn_[il], moe_, cur, il);
    }

    moe_hparams            moe_;
    std::vector<moe_layer> ffn_;
};

std::unique_ptr<target_model> open_qwen35moe(std::unique_ptr<gguf_file> file) {
    return std::make_unique<qwen35moe_model>(std::move(file));
}

}  // namespace pdf
