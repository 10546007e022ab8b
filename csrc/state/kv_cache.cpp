#include "state/kv_cache.h"
#include "core/error.h"
#include "core/graph_cache.h"
#include "core/log.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace pdf {

static bool is_allowed_kv_type(ggml_type t) {
    switch (t) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_IQ4_NL:
            return true;
        default:
            return false;
    }
}

void kv_cache::check_types(const model_info & info, ggml_type type_k, ggml_type type_v) {
    for (ggml_type t : {type_k, type_v}) {
        if (!is_allowed_kv_type(t)) {
            throw std::invalid_argument(format("kv cache type %s is not supported (expected one of f32, f16, bf16, "
                                               "q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl)", ggml_type_name(t)));
        }
    }
    for (const kv_layer_desc & l : info.kv_layers) {
        // a quantized row must hold whole blocks per head, or heads could not be viewed separately
        if (l.head_dim_k % ggml_blck_size(type_k) != 0 || l.head_dim_v % ggml_blck_size(type_v) != 0) {
            throw std::invalid_argument(format("kv cache types %s/%s need head sizes divisible by %lld/%lld, but layer "
                                               "%d has %lld/%lld", ggml_type_name(type_k), ggml_type_name(type_v),
                                               (long long) ggml_blck_size(type_k), (long long) ggml_blck_size(type_v),
                                               l.il, (long long) l.head_dim_k, (long long) l.head_dim_v));
        }
    }
}

size_t kv_cache::n_bytes_for(const model_info & info, uint32_t n_ctx, ggml_type type_k, ggml_type type_v) {
    size_t n = 0;
    for (const kv_layer_desc & l : info.kv_layers) {
        n += ggml_row_size(type_k, l.n_embd_k_gqa) * n_ctx + ggml_row_size(type_v, l.n_embd_v_gqa) * n_ctx;
    }
    return n;
}

kv_cache::kv_cache(const model_info & info, const backends & be, uint32_t n_ctx, ggml_type type_k, ggml_type type_v,
                   int placed_with)
    : n_ctx_(n_ctx), buffers_(2 * info.kv_layers.size()) {
    check_types(info, type_k, type_v);
    for (const kv_layer_desc & l : info.kv_layers) {
        ggml_backend_buffer_type_t buft = be.state_buft(placed_with == -2 ? l.il : placed_with);
        layers_[l.il] = {buffers_.add(type_k, l.n_embd_k_gqa, n_ctx, format("cache_k_l%d", l.il), buft),
                         buffers_.add(type_v, l.n_embd_v_gqa, n_ctx, format("cache_v_l%d", l.il), buft)};
    }
    if (ggml_backend_buffer_type_t failed = buffers_.allocate()) {
        throw context_overflow_error(format("could not allocate the KV cache (n_ctx = %u, %.1f MiB in all) in %s",
                                            n_ctx, n_bytes_for(info, n_ctx, type_k, type_v) / 1048576.0,
                                            ggml_backend_buft_name(failed)),
                                     0, n_ctx);
    }
    // slots past the committed ones are read masked: attention weighs them by 0, which keeps a NaN (whatever a
    // fresh allocation held) a NaN
    buffers_.clear();
}

kv_cache::~kv_cache() = default;

ggml_tensor * kv_cache::k(int il) const { return layers_.at(il).first; }
ggml_tensor * kv_cache::v(int il) const { return layers_.at(il).second; }

void kv_cache::fill(state_tensors & st, int n_layer) const {
    spread_by_layer(layers_, n_layer, st.k, st.v);
}

void kv_cache::add_inputs(ggml_context * ctx, kv_inputs & in, int n_tokens, int n_kv) const {
    in.n_kv    = n_kv;
    in.slots   = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    in.kq_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_tokens);
    ggml_set_input(in.slots);
    ggml_set_input(in.kq_mask);
}

void kv_cache::set_inputs(const kv_inputs & in, int n_past, int n, const int32_t * parent_slot,
                          const uint8_t * mask) {
    slots_host_.resize(n);
    for (int s = 0; s < n; ++s) {
        slots_host_[s] = n_past + s;
    }
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    mask_host_.assign((size_t) in.n_kv * n, ninf);
    for (int s = 0; s < n; ++s) {
        ggml_fp16_t * row = mask_host_.data() + (size_t) s * in.n_kv;
        std::fill(row, row + n_past, zero);
        if (parent_slot) {
            for (int a = s; a >= 0; a = parent_slot[a]) {  // itself and its ancestors
                row[n_past + a] = zero;
            }
        } else {
            for (int j = 0; j < n; ++j) {
                if (mask ? mask[(size_t) s * n + j] != 0 : j <= s) {
                    row[n_past + j] = zero;
                }
            }
        }
    }
    set_graph_input(in.slots, slots_host_.data(), 0, sizeof(int64_t) * n);
    set_graph_input(in.kq_mask, mask_host_.data(), 0, sizeof(ggml_fp16_t) * mask_host_.size());
}

void kv_cache::move_rows(const std::vector<std::pair<int, int>> & moves, const compute_backends & compute) {
    // In waves: a wave holds the moves whose destination no later move still has to read, so the copies of one
    // graph never depend on each other's order (a backend may run independent nodes in any order); a wave per
    // graph compute, usually one.
    std::vector<std::pair<int, int>> left = moves, wave;
    while (!left.empty()) {
        wave.clear();
        std::vector<std::pair<int, int>> later;
        for (size_t i = 0; i < left.size(); ++i) {
            bool read_later = false;
            for (size_t j = 0; j < left.size() && !read_later; ++j) {
                read_later = j != i && left[j].first == left[i].second;
            }
            (read_later ? later : wave).push_back(left[i]);
        }
        if (wave.empty()) {
            throw std::logic_error("move_rows: the moves form a cycle");  // never from a commit (destinations
                                                                          // are below their sources)
        }
        copy_rows(wave, compute);
        left.swap(later);
    }
}

void kv_cache::copy_rows(const std::vector<std::pair<int, int>> & moves, const compute_backends & compute) {
    // one small graph of row copies (same type: a plain copy, also of quantized rows) per device that holds
    // cache layers
    std::vector<ggml_backend_t> backends(compute.gpus());
    backends.push_back(compute.cpu());
    for (ggml_backend_t backend : backends) {
        std::vector<ggml_tensor *> tensors;
        for (const auto & kv : layers_) {
            for (ggml_tensor * t : {kv.second.first, kv.second.second}) {
                const bool host = ggml_backend_buffer_is_host(t->buffer);
                if (backend == compute.cpu() ? host
                                             : !host && ggml_backend_supports_buft(backend,
                                                                                   ggml_backend_buffer_get_type(t->buffer))) {
                    tensors.push_back(t);
                }
            }
        }
        if (tensors.empty()) {
            continue;
        }
        const size_t         n_nodes = 3 * tensors.size() * moves.size() + 16;
        std::vector<uint8_t> meta(ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false));
        ggml_init_params     params = {meta.size(), meta.data(), true};
        ggml_context *       ctx    = ggml_init(params);
        ggml_cgraph *        gf     = ggml_new_graph_custom(ctx, n_nodes, false);
        for (ggml_tensor * t : tensors) {
            for (const auto & m : moves) {
                ggml_tensor * src = ggml_view_1d(ctx, t, t->ne[0], (size_t) m.first * t->nb[1]);
                ggml_tensor * dst = ggml_view_1d(ctx, t, t->ne[0], (size_t) m.second * t->nb[1]);
                ggml_build_forward_expand(gf, ggml_cpy(ctx, src, dst));
            }
        }
        // views made over an allocated tensor have its address but no buffer, which the CPU does not need and a
        // device backend may (an RPC device sends tensors by buffer: without one they arrived as null pointers)
        for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
            if (t->view_src && !t->buffer && ggml_backend_view_init(t) != GGML_STATUS_SUCCESS) {
                ggml_free(ctx);
                throw backend_error("could not move KV cache rows");
            }
        }
        const ggml_status status = compute.compute(backend, gf);
        ggml_free(ctx);
        if (status != GGML_STATUS_SUCCESS) {
            throw backend_error("could not move KV cache rows");
        }
    }
}

size_t kv_cache::n_bytes() const {
    return memory().total();
}

device_bytes kv_cache::memory() const {
    return buffers_.memory();
}

}  // namespace pdf
