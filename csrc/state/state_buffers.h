// The tensors of one piece of per-session state (the KV cache, the recurrent state, the feature ring) and the
// device buffers that hold them: each tensor is declared with the buffer type it goes to, then allocate()
// places them all, one buffer per buffer type, in the order they were declared. Freed together.
#pragma once

#include "core/backend.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace pdf {

class state_buffers {
  public:
    explicit state_buffers(size_t max_tensors);
    ~state_buffers();
    state_buffers(const state_buffers &)             = delete;
    state_buffers & operator=(const state_buffers &) = delete;

    // a 2-D tensor [ne0, ne1] named `name`, to go into a buffer of type `buft`
    ggml_tensor * add(ggml_type type, int64_t ne0, int64_t ne1, const std::string & name,
                      ggml_backend_buffer_type_t buft);
    // allocates (zeroed) every tensor added; nullptr on success, else the buffer type that could not be had
    // (nothing stays allocated then; the caller names what failed)
    ggml_backend_buffer_type_t allocate();
    // every byte back to zero
    void         clear();
    device_bytes memory() const { return bytes_by_device(buffers_); }

  private:
    void release();

    ggml_context *                                                    ctx_ = nullptr;
    std::map<ggml_backend_buffer_type_t, std::vector<ggml_tensor *>> by_buft_;
    std::vector<ggml_backend_buffer_t>                                buffers_;
};

// per layer index: two tensors (K and V, or ssm and conv); spread over vectors indexed by layer (nullptr where a
// layer has none), as the graph builders read them (core/model_desc.h, state_tensors)
using layer_tensors = std::map<int, std::pair<ggml_tensor *, ggml_tensor *>>;
void spread_by_layer(const layer_tensors & layers, int n_layer, std::vector<ggml_tensor *> & first,
                     std::vector<ggml_tensor *> & second);

}  // namespace pdf
