#include "state/state_buffers.h"

#include <string>

namespace pdf {

state_buffers::state_buffers(size_t max_tensors) {
    ggml_init_params params = {ggml_tensor_overhead() * (max_tensors + 1), nullptr, true};
    ctx_                    = ggml_init(params);
}

state_buffers::~state_buffers() {
    release();
    ggml_free(ctx_);
}

ggml_tensor * state_buffers::add(ggml_type type, int64_t ne0, int64_t ne1, const std::string & name,
                                 ggml_backend_buffer_type_t buft) {
    ggml_tensor * t = ggml_new_tensor_2d(ctx_, type, ne0, ne1);
    ggml_set_name(t, name.c_str());
    by_buft_[buft].push_back(t);
    return t;
}

ggml_backend_buffer_type_t state_buffers::allocate() {
    for (auto & kv : by_buft_) {
        ggml_backend_buffer_t buf = alloc_tensors(kv.first, kv.second);
        if (!buf) {
            release();
            return kv.first;
        }
        buffers_.push_back(buf);
    }
    return nullptr;
}

void state_buffers::clear() {
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_clear(b, 0);
    }
}

void state_buffers::release() {
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_free(b);
    }
    buffers_.clear();
}

void spread_by_layer(const layer_tensors & layers, int n_layer, std::vector<ggml_tensor *> & first,
                     std::vector<ggml_tensor *> & second) {
    first.assign(n_layer, nullptr);
    second.assign(n_layer, nullptr);
    for (const auto & kv : layers) {
        first[kv.first]  = kv.second.first;
        second[kv.first] = kv.second.second;
    }
}

}  // namespace pdf
