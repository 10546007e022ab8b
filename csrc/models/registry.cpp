// The one table that maps general.architecture to a model factory.
#include "core/error.h"
#include "models/model.h"

#include <functional>
#include <map>

namespace pdf {

std::unique_ptr<target_model> load_qwen3(std::unique_ptr<gguf_file> file, const model_params & params);
std::unique_ptr<target_model> load_qwen35(std::unique_ptr<gguf_file> file, const model_params & params);

using model_factory = std::function<std::unique_ptr<target_model>(std::unique_ptr<gguf_file>, const model_params &)>;

static const std::map<std::string, model_factory> & registry() {
    static const std::map<std::string, model_factory> table = {
        {"qwen3", load_qwen3},
        {"qwen35", load_qwen35},
    };
    return table;
}

void target_model::load_embedding_and_head(int64_t n_embd, int64_t n_vocab) {
    weights & w      = *weights_;
    const int out_il = info_.n_layer;
    tok_embd_        = w.require("token_embd.weight", {n_embd, n_vocab}, -1, WEIGHT_USE_GET_ROWS);
    output_          = w.optional("output.weight", {n_embd, n_vocab}, out_il, WEIGHT_USE_MATMUL);
    if (!output_) {
        // tied head: a second copy when the head's buffer type differs (a repacked or GPU copy makes the largest
        // matmul of a decode step several times faster; llama.cpp duplicates it too)
        ggml_tensor * meta = file_->find_tensor("token_embd.weight");
        output_ = backends_->weight_buft(out_il, WEIGHT_USE_MATMUL, meta) ==
                          backends_->weight_buft(-1, WEIGHT_USE_GET_ROWS, meta)
                      ? tok_embd_
                      : w.require("token_embd.weight", {n_embd, n_vocab}, out_il, WEIGHT_USE_MATMUL);
    }
}

std::unique_ptr<target_model> load_target_model(const std::string & path, const model_params & params) {
    auto        file = std::make_unique<gguf_file>(path, params.plan_only);
    std::string arch = file->arch();
    auto        it   = registry().find(arch);
    if (it == registry().end()) {
        std::string known;
        for (auto & kv : registry()) {
            known += (known.empty() ? "" : ", ") + kv.first;
        }
        throw unsupported_error(format("%s: general.architecture = '%s' is not a supported target (expected one of: %s)",
                                       path.c_str(), arch.c_str(), known.c_str()));
    }
    return it->second(std::move(file), params);
}

}  // namespace pdf
