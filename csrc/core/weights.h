// The read-only weights of one model: tensors declared from a GGUF (checked against the expected shape),
// placed per layer on the CPU or GPU in the right buffer type, then filled from the mapped file.
#pragma once

#include "core/backend.h"
#include "core/gguf_file.h"

#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

namespace pdf {

// progress of a load: bytes read so far, bytes in all
using load_progress = std::function<void(size_t done, size_t total)>;

class weights {
  public:
    weights(const gguf_file & file, const backends & be);
    ~weights();
    weights(const weights &)             = delete;
    weights & operator=(const weights &) = delete;

    // declare a weight of layer `il` (-1: input embeddings, n_layer: output head); shape in ggml order
    ggml_tensor * require(const std::string & name, std::initializer_list<int64_t> ne, int il, weight_use use);
    ggml_tensor * optional(const std::string & name, std::initializer_list<int64_t> ne, int il, weight_use use);
    // a second copy of a 2-D F32 weight, transposed ([ne1, ne0]), for a graph block that needs the other
    // layout (per-channel conv kernel taps): made once at load
    ggml_tensor * transposed_copy(const std::string & name, int il, weight_use use);
    // allocates the buffers and reads every tensor, calling progress(bytes read, bytes in all) as it goes (a
    // plan's: planned buffers, nothing read)
    void   load(const load_progress & progress = {});
    // a plan's weights become a load's, once their backends have (backends::realize): the same tensors, moved
    // into real buffers of the types the planned ones stood for, and read
    void   realize(const load_progress & progress = {});
    size_t       n_bytes() const;
    device_bytes memory() const;
    // the stacked experts' share of memory() (the weights declared WEIGHT_USE_MATMUL_ID)
    device_bytes expert_memory() const;
    // where each weight went: (tensor name, buffer type name, on the GPU), after load()
    struct placed {
        std::string name;
        std::string buffer_type;
        bool        on_gpu;
    };
    std::vector<placed> placement() const;

  private:
    void           allocate();                             // a buffer per buffer type, holding its tensors
    void           read(const load_progress & progress);  // every tensor's data from the file
    ggml_context * context_for(ggml_backend_buffer_type_t buft);
    ggml_tensor *  add(ggml_tensor * meta, int il, weight_use use);

    const gguf_file &                                   file_;
    const backends &                                    be_;
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_by_buft_;
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> to_load_;       // (ours, file metadata)
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> to_transpose_;  // (ours, file metadata)
    std::vector<ggml_backend_buffer_t>                  buffers_;
    std::vector<ggml_tensor *>                          experts_;
    bool                                                planned_ = false;  // in a plan's buffers, nothing read
};

}  // namespace pdf
