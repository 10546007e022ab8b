// K and V of every attention layer of one session: per layer two 2-D tensors [n_embd_gqa, n_ctx] of the
// chosen type (f32, f16, bf16, q8_0, q4_0 ...), row r holding the token in cache slot r. Rows are written
// inside the graph with ggml_set_rows, so the graph does not depend on where it writes.
#pragma once

#include "core/backend.h"
#include "core/model_desc.h"
#include "state/state_buffers.h"

#include <utility>
#include <vector>

namespace pdf {

class kv_cache {
  public:
    // placed_with: the layer of `be` whose device holds every layer's rows (-2: each layer's own; a drafter's
    // cache lives with its weights, on the device of the target's last layer)
    kv_cache(const model_info & info, const backends & be, uint32_t n_ctx, ggml_type type_k, ggml_type type_v,
             int placed_with = -2);
    ~kv_cache();
    kv_cache(const kv_cache &)             = delete;
    kv_cache & operator=(const kv_cache &) = delete;

    // bytes the cache would take, computed without allocating (reported before allocation)
    static size_t n_bytes_for(const model_info & info, uint32_t n_ctx, ggml_type type_k, ggml_type type_v);
    // throws std::invalid_argument when a type is not allowed for this model's head sizes
    static void check_types(const model_info & info, ggml_type type_k, ggml_type type_v);

    ggml_tensor * k(int il) const;
    ggml_tensor * v(int il) const;
    // the K/V tensors by layer index, for the graph builders
    void          fill(state_tensors & st, int n_layer) const;
    // the graph inputs of a batch of n_tokens over cache rows 0..n_kv-1 (core/model_desc.h), new in ctx
    void          add_inputs(ggml_context * ctx, kv_inputs & in, int n_tokens, int n_kv) const;
    // sets them for a batch of n tokens written to slots n_past .. n_past+n-1; each sees the committed past and,
    // in the batch, with parent_slot (a tree: parent slot of each slot, -1 the past) its ancestors and itself,
    // else with mask ([n, n]: slot i sees slot j iff mask[i*n + j] != 0) those it names, else those before it
    void          set_inputs(const kv_inputs & in, int n_past, int n, const int32_t * parent_slot,
                             const uint8_t * mask);
    // copy the rows of every layer's K and V from slot `first` to slot `second` of each pair, on the device;
    // every row is read before it is overwritten (the pairs must not form a cycle); computed on `compute`
    void          move_rows(const std::vector<std::pair<int, int>> & moves, const compute_backends & compute);
    uint32_t      n_ctx() const { return n_ctx_; }
    size_t        n_bytes() const;
    device_bytes  memory() const;

  private:
    // one graph of copies that do not depend on each other's order
    void copy_rows(const std::vector<std::pair<int, int>> & moves, const compute_backends & compute);

    uint32_t                 n_ctx_;
    state_buffers            buffers_;
    layer_tensors            layers_;
    std::vector<ggml_fp16_t> mask_host_;  // kept from batch to batch: no allocation per token
    std::vector<int64_t>     slots_host_;
};

}  // namespace pdf
