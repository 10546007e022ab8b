// Buffer types for memory plans (pydflash.plan): a plan builds the model, its sessions and their graphs exactly
// as a load does, only in buffers of these types, so every size it reports comes from the same code and from
// ggml's own sizing of each buffer type: the real buffer type's alignment and per-tensor allocation size, or,
// for layers placed on a GPU this machine does not have, CUDA's (tensors 128-byte aligned, a quantized matrix
// padded by up to 512 elements of one row, as ggml-cuda's buffer type does). Their buffers reserve address
// space only (never backed: nothing is read from the file into them, and nothing computes on them); they are
// host buffers, so ggml's CPU scheduler can measure the graphs over them.
#pragma once

#include "ggml-backend.h"

namespace pdf {

// the plan's twin of `real` (nullptr: a GPU that is absent); `on_gpu` says which device the plan counts it on
ggml_backend_buffer_type_t planned_buft(ggml_backend_buffer_type_t real, bool on_gpu);
// the buffer type `planned` (a planned_buft) stands for: nullptr for an absent GPU, `planned` itself when it is
// not a planned type
ggml_backend_buffer_type_t real_buft(ggml_backend_buffer_type_t planned);
// whether the buffer lives on the GPU (a planned one: the device its plan placed it on)
bool                       buffer_on_gpu(ggml_backend_buffer_t buffer);

}  // namespace pdf
