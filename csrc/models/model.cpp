// The steps every model shares (models/model.h): reading its weights, and for targets the embedding, the head,
// the final norm and the layer stack.
#include "models/model.h"
#include "core/error.h"
#include "models/blocks.h"

namespace pdf {

loaded_model::loaded_model(std::unique_ptr<gguf_file> file) : file_(std::move(file)) {}

loaded_model::~loaded_model() = default;

void loaded_model::read_weights(std::shared_ptr<backends> devices, const load_progress & progress) {
    devices_ = std::move(devices);
    weights_ = std::make_unique<weights>(*file_, *devices_);
    declare_weights(*weights_);
    weights_->load(progress);
}

void loaded_model::realize_weights(const load_progress & progress) {
    weights_->realize(progress);
}

void target_model::realize(const model_params & params) {
    if (!devices_->plan_only()) {
        throw std::invalid_argument(format("%s: the weights are loaded already (realize is for a memory plan's "
                                           "model)", file_->path().c_str()));
    }
    file_->require_data();  // before anything changes: a truncated file leaves the plan as it was
    devices_->realize(params.n_threads, params.n_gpu_layers, params.n_cpu_moe, params.tensor_split);
    realize_weights(params.progress);
    loaded(params);
}

int target_model::verify_row_tile() const {
    constexpr int CPU_ROW_TILE = 4;
    return devices_->computes_on_gpu() || expert_memory().total() > 0 ? 1 : CPU_ROW_TILE;
}

void target_model::describe(const std::string & arch, int64_t n_embd, int n_layer, uint32_t n_ctx_train,
                            float norm_eps) {
    ggml_tensor * embd = file_->find_tensor("token_embd.weight");
    if (!embd) {
        throw format_error(format("%s: missing required tensor 'token_embd.weight'", file_->path().c_str()));
    }
    info_.arch        = arch;
    info_.path        = file_->path();
    info_.n_vocab     = embd->ne[1];
    info_.n_embd      = n_embd;
    info_.n_layer     = n_layer;
    info_.n_ctx_train = n_ctx_train;
    norm_eps_         = norm_eps;
}

void target_model::load(const model_params & params) {
    read_weights(std::make_shared<backends>(params.n_threads, params.n_gpu_layers, params.n_cpu_moe,
                                            params.tensor_split, info_.n_layer, params.plan_only),
                 params.progress);
    loaded(params);
}

void target_model::declare_weights(weights & w) {
    const int64_t E = info_.n_embd, V = info_.n_vocab;
    const int     out_il = info_.n_layer;
    tok_embd_ = w.require("token_embd.weight", {E, V}, -1, WEIGHT_USE_GET_ROWS);
    output_   = w.optional("output.weight", {E, V}, out_il, WEIGHT_USE_MATMUL);
    if (!output_) {
        // tied head: a second copy when the head's buffer type differs (a repacked or GPU copy makes the largest
        // matmul of a decode step several times faster; llama.cpp duplicates it too)
        ggml_tensor * meta = file_->find_tensor("token_embd.weight");
        output_ = devices_->weight_buft(out_il, WEIGHT_USE_MATMUL, meta) ==
                          devices_->weight_buft(-1, WEIGHT_USE_GET_ROWS, meta)
                      ? tok_embd_
                      : w.require("token_embd.weight", {E, V}, out_il, WEIGHT_USE_MATMUL);
    }
    output_norm_ = w.require("output_norm.weight", {E}, out_il, WEIGHT_USE_OTHER);
    for (int il = 0; il < info_.n_layer; ++il) {
        declare_layer(w, il);
    }
    declare_extra(w);
}

std::string target_model::mtp_missing() const {
    return format("%s: architecture '%s' has no multi-token-prediction head", file_->path().c_str(),
                  info_.arch.c_str());
}

ggml_tensor * target_model::build_mtp(ggml_context *, ggml_cgraph *, const eval_inputs &, const state_tensors &,
                                      ggml_tensor *, bool) const {
    throw unsupported_error(mtp_missing());
}

ggml_tensor * target_model::build_output_norm(ggml_context * ctx, ggml_tensor * x) const {
    return build_rms_norm(ctx, x, output_norm_, norm_eps_);
}

// tokens [n] -> x [E, n] -> layer 0 .. n_layer-1 -> [E, n_outputs] after the final norm; captured: [E, n] each
eval_outputs target_model::build_eval(ggml_context * ctx, ggml_cgraph * gf, const eval_inputs & in,
                                      const state_tensors & st) const {
    const int    n_layer = info_.n_layer;
    eval_outputs out;
    out.captured.assign(in.capture_layers.size(), nullptr);

    const bool    last_only = last_layer_for_last_token_only(in, n_layer);
    ggml_tensor * x         = ggml_get_rows(ctx, tok_embd_, in.tokens);  // [E, n]
    for (int il = 0; il <= n_layer; ++il) {
        // DFlash reads layer inputs (llama.cpp's t_layer_inp); index n_layer is the final pre-norm output
        for (size_t c = 0; c < in.capture_layers.size(); ++c) {
            if (in.capture_layers[c] == il) {
                out.captured[c] = x;
            }
        }
        if (il < n_layer) {
            x = build_layer(ctx, gf, in, st, il, x, il == n_layer - 1 && last_only);
        }
    }
    if (!in.sequences.empty()) {
        x = ggml_get_rows(ctx, x, in.output_rows);  // [E, n_outputs]: the rows each session reads
    } else if (!in.all_outputs && x->ne[1] > 1) {
        x = last_token(ctx, x);  // the final hidden state was captured for every token
    }
    out.hidden = build_output_norm(ctx, x);
    return out;
}

}  // namespace pdf
