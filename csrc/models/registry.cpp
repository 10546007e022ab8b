// The one table that maps general.architecture to a model factory.
#include "core/error.h"
#include "models/model.h"

#include <functional>
#include <map>

namespace pdf {

// each reads its architecture's hyper-parameters from the file (load_target_model then reads the weights)
std::unique_ptr<target_model> open_qwen3(std::unique_ptr<gguf_file> file);
std::unique_ptr<target_model> open_qwen35(std::unique_ptr<gguf_file> file);
std::unique_ptr<target_model> open_qwen3moe(std::unique_ptr<gguf_file> file);
std::unique_ptr<target_model> open_qwen35moe(std::unique_ptr<gguf_file> file);

using model_factory = std::function<std::unique_ptr<target_model>(std::unique_ptr<gguf_file>)>;

static const std::map<std::string, model_factory> & registry() {
    static const std::map<std::string, model_factory> table = {
        {"qwen3", open_qwen3},
        {"qwen35", open_qwen35},
        {"qwen3moe", open_qwen3moe},
        {"qwen35moe", open_qwen35moe},
    };
    return table;
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
    std::unique_ptr<target_model> model = it->second(std::move(file));
    model->load(params);
    return model;
}

}  // namespace pdf
