#include "state/kv_cache.h"
#include "core/error.h"
#include "core/log.h"

#include "ggml-alloc.h"

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

kv_cache::kv_cache(const model_info & info, const backends & be, uint32_t n_ctx, ggml_type type_k, ggml_type type_v)
    : n_ctx_(n_ctx) {
    check_types(info, type_k, type_v);
    ggml_init_params params = {ggml_tensor_overhead() * (2 * info.kv_layers.size() + 1), nullptr, true};
    ctx_                    = ggml_init(params);

    std::map<ggml_backend_buffer_type_t, std::vector<ggml_tensor *>> by_buft;
    for (const kv_layer_desc & l : info.kv_layers) {
        ggml_tensor * k = ggml_new_tensor_2d(ctx_, type_k, l.n_embd_k_gqa, n_ctx);
        ggml_tensor * v = ggml_new_tensor_2d(ctx_, type_v, l.n_embd_v_gqa, n_ctx);
        ggml_format_name(k, "cache_k_l%d", l.il);
        ggml_format_name(v, "cache_v_l%d", l.il);
        layers_[l.il] = {k, v};
        ggml_backend_buffer_type_t buft = be.state_buft(l.il);
        by_buft[buft].push_back(k);
        by_buft[buft].push_back(v);
    }
    for (auto & kv : by_buft) {
        ggml_backend_buffer_t buf = alloc_tensors(kv.first, kv.second);
        if (!buf) {
            throw context_overflow_error(format("could not allocate the KV cache (n_ctx = %u, %.1f MiB in all) in %s",
                                                n_ctx, n_bytes_for(info, n_ctx, type_k, type_v) / 1048576.0,
                                                ggml_backend_buft_name(kv.first)),
                                         0, n_ctx);
        }
        buffers_.push_back(buf);
    }
}

kv_cache::~kv_cache() {
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_free(b);
    }
    if (ctx_) {
        ggml_free(ctx_);
    }
}

ggml_tensor * kv_cache::k(int il) const { return layers_.at(il).first; }
ggml_tensor * kv_cache::v(int il) const { return layers_.at(il).second; }

size_t kv_cache::n_bytes() const {
    size_t n = 0;
    for (ggml_backend_buffer_t b : buffers_) {
        n += ggml_backend_buffer_get_size(b);
    }
    return n;
}

}  // namespace pdf
