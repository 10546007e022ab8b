#include "core/weights.h"
#include "core/error.h"
#include "core/log.h"
#include "core/planned_buffer.h"

#include "ggml-alloc.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <cstdint>

namespace pdf {

// Weights in system memory (the CPU's plain and repacking buffer types alike) on 2 MiB pages where the kernel
// grants them on request (transparent huge pages in `madvise` mode, a common default): a decode step reads
// every active weight once, and with 4 KiB pages its TLB misses cost the random 1.1B MoE (benchmarks/bench_moe.py
// table 3) 10-14% of its decode speed, q8_0 and q4_0 alike. llama.cpp maps the file instead. Asked before the
// weights are written, so the pages are huge from their first touch; a refusal leaves small pages.
static void advise_huge_pages(ggml_backend_buffer_type_t buft, ggml_backend_buffer_t buf) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // ggml's plain CPU buffer type names no device; the repacking ones name the CPU (and are not "host")
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (buft != ggml_backend_cpu_buffer_type() && !(dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU)) {
        return;
    }
    const uintptr_t page  = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t base  = (uintptr_t) ggml_backend_buffer_get_base(buf);
    const uintptr_t first = (base + page - 1) / page * page;
    const uintptr_t end   = (base + ggml_backend_buffer_get_size(buf)) / page * page;
    if (end > first) {
        madvise((void *) first, end - first, MADV_HUGEPAGE);  // advice: its failure changes nothing
    }
#else
    (void) buft;
    (void) buf;
#endif
}

weights::weights(const gguf_file & file, const backends & be) : file_(file), be_(be) {}

weights::~weights() {
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_free(b);
    }
    for (auto & kv : ctx_by_buft_) {
        ggml_free(kv.second);
    }
}

ggml_context * weights::context_for(ggml_backend_buffer_type_t buft) {
    ggml_context *& ctx = ctx_by_buft_[buft];
    if (!ctx) {
        // every file tensor at most once, and each may have a transposed copy
        ggml_init_params params = {ggml_tensor_overhead() * (2 * file_.n_tensors() + 1), nullptr, true};
        ctx                     = ggml_init(params);
    }
    return ctx;
}

ggml_tensor * weights::add(ggml_tensor * meta, int il, weight_use use) {
    ggml_tensor * t = ggml_dup_tensor(context_for(be_.weight_buft(il, use, meta)), meta);
    ggml_set_name(t, ggml_get_name(meta));
    to_load_.emplace_back(t, meta);
    if (use == WEIGHT_USE_MATMUL_ID) {
        experts_.push_back(t);
    }
    return t;
}

ggml_tensor * weights::transposed_copy(const std::string & name, int il, weight_use use) {
    ggml_tensor * meta = file_.find_tensor(name);
    if (!meta || meta->type != GGML_TYPE_F32 || ggml_n_dims(meta) > 2) {
        throw format_error(format("%s: tensor '%s' %s, expected a 2-D f32 tensor", file_.path().c_str(), name.c_str(),
                                  meta ? "has another type or shape" : "is missing"));
    }
    ggml_context * ctx = context_for(be_.weight_buft(il, use, meta));
    ggml_tensor *  t   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, meta->ne[1], meta->ne[0]);
    ggml_format_name(t, "%s.T", name.c_str());
    to_transpose_.emplace_back(t, meta);
    return t;
}

ggml_tensor * weights::require(const std::string & name, std::initializer_list<int64_t> ne, int il, weight_use use) {
    return add(file_.require_tensor(name, ne), il, use);
}

ggml_tensor * weights::optional(const std::string & name, std::initializer_list<int64_t> ne, int il,
                                weight_use use) {
    ggml_tensor * meta = file_.optional_tensor(name, ne);
    return meta ? add(meta, il, use) : nullptr;
}

void weights::load(const load_progress & progress) {
    allocate();
    planned_ = be_.plan_only();
    if (!planned_) {  // a plan reads no tensor data (the file may hold none) until realize()
        read(progress);
    }
}

void weights::realize(const load_progress & progress) {
    if (!planned_) {
        throw std::invalid_argument(format("%s: the weights are loaded already (realize is for a memory plan's)",
                                           file_.path().c_str()));
    }
    if (be_.plan_only()) {
        throw std::logic_error("weights::realize: their backends are still a plan's (backends::realize first)");
    }
    // the same tensors (the model's pointers to them stay valid), out of the planned buffers and into the
    // buffer types those stood for
    std::map<ggml_backend_buffer_type_t, ggml_context *> by_real_buft;
    for (auto & kv : ctx_by_buft_) {
        ggml_backend_buffer_type_t buft = real_buft(kv.first);
        if (!buft || by_real_buft.count(buft)) {
            throw backend_error(format("%s: weights planned in %s cannot be loaded on this machine",
                                       file_.path().c_str(), ggml_backend_buft_name(kv.first)));
        }
        for (ggml_tensor * t = ggml_get_first_tensor(kv.second); t; t = ggml_get_next_tensor(kv.second, t)) {
            t->buffer = nullptr;
            t->data   = nullptr;
        }
        by_real_buft[buft] = kv.second;
    }
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_free(b);
    }
    buffers_.clear();
    ctx_by_buft_ = std::move(by_real_buft);
    load(progress);
}

void weights::allocate() {
    for (auto & kv : ctx_by_buft_) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(kv.second, kv.first);
        if (!buf) {
            throw backend_error(format("%s: could not allocate the weights in buffer type %s", file_.path().c_str(),
                                       ggml_backend_buft_name(kv.first)));
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        buffers_.push_back(buf);
        if (!be_.plan_only()) {
            advise_huge_pages(kv.first, buf);
            PDF_LOG_INFO("%s: %.2f MiB of weights in %s", file_.path().c_str(),
                         ggml_backend_buffer_get_size(buf) / 1048576.0, ggml_backend_buft_name(kv.first));
        }
    }
}

void weights::read(const load_progress & progress) {
    size_t total = 0, done = 0;
    for (auto & p : to_load_) {
        total += ggml_nbytes(p.second);
    }
    for (auto & p : to_transpose_) {
        total += ggml_nbytes(p.second);
    }
    for (auto & p : to_load_) {
        ggml_backend_tensor_set(p.first, file_.tensor_data(p.second), 0, ggml_nbytes(p.second));
        done += ggml_nbytes(p.second);
        if (progress) {
            progress(done, total);
        }
    }
    to_load_.clear();
    std::vector<float> tmp;
    for (auto & p : to_transpose_) {
        const int64_t a = p.second->ne[0], b = p.second->ne[1];
        const float * src = (const float *) file_.tensor_data(p.second);
        tmp.resize((size_t) a * b);
        for (int64_t i = 0; i < b; ++i) {
            for (int64_t j = 0; j < a; ++j) {
                tmp[(size_t) j * b + i] = src[(size_t) i * a + j];
            }
        }
        ggml_backend_tensor_set(p.first, tmp.data(), 0, tmp.size() * sizeof(float));
        done += ggml_nbytes(p.second);
        if (progress) {
            progress(done, total);
        }
    }
    to_transpose_.clear();
}

std::vector<weights::placed> weights::placement() const {
    std::vector<placed> out;
    for (const auto & kv : ctx_by_buft_) {
        for (ggml_tensor * t = ggml_get_first_tensor(kv.second); t; t = ggml_get_next_tensor(kv.second, t)) {
            if (t->buffer) {
                out.push_back({ggml_get_name(t), ggml_backend_buft_name(kv.first), buffer_on_gpu(t->buffer)});
            }
        }
    }
    return out;
}

device_bytes weights::memory() const {
    return bytes_by_device(buffers_);
}

device_bytes weights::expert_memory() const {
    device_bytes n;
    for (ggml_tensor * t : experts_) {
        if (t->buffer) {
            (buffer_on_gpu(t->buffer) ? n.gpu : n.cpu) +=
                ggml_backend_buffer_get_alloc_size(t->buffer, t);
        }
    }
    return n;
}

size_t weights::n_bytes() const {
    return memory().total();
}

}  // namespace pdf
