#include "core/planned_buffer.h"

#include "ggml-backend-impl.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <sys/mman.h>
#include <unistd.h>

namespace pdf {

namespace {

struct planned_type {
    ggml_backend_buffer_type_t real;  // nullptr: an absent GPU (CUDA's sizing)
    bool                       on_gpu;
    std::string                name;
};

struct planned_storage {
    void * base;
    size_t mapped;
};

constexpr size_t CUDA_ALIGNMENT          = 128;  // ggml-cuda's buffer type
constexpr int64_t CUDA_MATRIX_ROW_PADDING = 512;  // ggml-cuda pads quantized rows to this many elements

planned_type * type_of(ggml_backend_buffer_type_t buft) { return (planned_type *) buft->context; }

const char * planned_name(ggml_backend_buffer_type_t buft) { return type_of(buft)->name.c_str(); }

void planned_free(ggml_backend_buffer_t buffer) {
    auto * s = (planned_storage *) buffer->context;
    munmap(s->base, s->mapped);
    delete s;
}

void * planned_base(ggml_backend_buffer_t buffer) { return ((planned_storage *) buffer->context)->base; }

// reads and writes go to the reserved pages (committed only where touched: a plan writes no tensor data, but
// a session may set a few small inputs)
void planned_memset(ggml_backend_buffer_t, ggml_tensor * t, uint8_t value, size_t offset, size_t size) {
    memset((char *) t->data + offset, value, size);
}
void planned_set(ggml_backend_buffer_t, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    memcpy((char *) t->data + offset, data, size);
}
void planned_get(ggml_backend_buffer_t, const ggml_tensor * t, void * data, size_t offset, size_t size) {
    memcpy(data, (const char *) t->data + offset, size);
}
void planned_clear(ggml_backend_buffer_t, uint8_t) {}  // zero pages stay unbacked

const ggml_backend_buffer_i planned_buffer_iface = {
    /* .free_buffer   = */ planned_free,
    /* .get_base      = */ planned_base,
    /* .init_tensor   = */ nullptr,
    /* .memset_tensor = */ planned_memset,
    /* .set_tensor    = */ planned_set,
    /* .get_tensor    = */ planned_get,
    /* .set_tensor_2d = */ nullptr,
    /* .get_tensor_2d = */ nullptr,
    /* .cpy_tensor    = */ nullptr,
    /* .clear         = */ planned_clear,
    /* .reset         = */ nullptr,
};

size_t planned_alignment(ggml_backend_buffer_type_t buft) {
    planned_type * p = type_of(buft);
    return p->real ? ggml_backend_buft_get_alignment(p->real) : CUDA_ALIGNMENT;
}

ggml_backend_buffer_t planned_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    const size_t page   = (size_t) sysconf(_SC_PAGESIZE);
    const size_t mapped = (std::max<size_t>(size, 1) + page - 1) / page * page;
    void * base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
        return nullptr;
    }
    return ggml_backend_buffer_init(buft, planned_buffer_iface, new planned_storage{base, mapped}, size);
}

size_t planned_max_size(ggml_backend_buffer_type_t buft) {
    planned_type * p = type_of(buft);
    return p->real ? ggml_backend_buft_get_max_size(p->real) : SIZE_MAX;
}

size_t planned_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * t) {
    planned_type * p = type_of(buft);
    if (p->real) {
        return ggml_backend_buft_get_alloc_size(p->real, t);
    }
    size_t size = ggml_nbytes(t);
    if (ggml_is_quantized(t->type) && t->ne[0] % CUDA_MATRIX_ROW_PADDING != 0) {
        size += ggml_row_size(t->type, CUDA_MATRIX_ROW_PADDING - t->ne[0] % CUDA_MATRIX_ROW_PADDING);
    }
    return size;
}

bool planned_is_host(ggml_backend_buffer_type_t) { return true; }

const ggml_backend_buffer_type_i planned_type_iface = {
    /* .get_name       = */ planned_name,
    /* .alloc_buffer   = */ planned_alloc,
    /* .get_alignment  = */ planned_alignment,
    /* .get_max_size   = */ planned_max_size,
    /* .get_alloc_size = */ planned_alloc_size,
    /* .is_host        = */ planned_is_host,
};

}  // namespace

ggml_backend_buffer_type_t planned_buft(ggml_backend_buffer_type_t real, bool on_gpu) {
    // one twin per (type, device), kept for the process's life as ggml's own buffer types are
    static std::mutex                                                              mutex;
    static std::map<std::pair<ggml_backend_buffer_type_t, bool>, ggml_backend_buffer_type *> twins;
    std::lock_guard<std::mutex> lock(mutex);
    ggml_backend_buffer_type *& twin = twins[{real, on_gpu}];
    if (!twin) {
        std::string name = std::string("planned ") + (real ? ggml_backend_buft_name(real) : "GPU (CUDA sizing)");
        twin = new ggml_backend_buffer_type{planned_type_iface, ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU),
                                            new planned_type{real, on_gpu, name}};
    }
    return twin;
}

ggml_backend_buffer_type_t real_buft(ggml_backend_buffer_type_t planned) {
    return planned->iface.get_name == planned_name ? type_of(planned)->real : planned;
}

bool buffer_on_gpu(ggml_backend_buffer_t buffer) {
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(buffer);
    if (buft->iface.get_name == planned_name) {
        return type_of(buft)->on_gpu;
    }
    // by device, not by is_host: the CPU's repacking buffer types are not host memory in ggml's sense
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    return dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU;
}

}  // namespace pdf
