// Compute devices for one model: the CPU always, plus the first GPU device when ggml was built with one (CUDA,
// HIP, Vulkan, Metal ...). `backends` decides where each weight and each piece of session state lives
// (n_gpu_layers) and which buffer type holds it (the CPU's repacking buffer types for matmul weights, as
// llama.cpp does); it is shared, read-only, by every session over the model. `compute_backends` are the backend
// instances one session computes with: a CPU backend has a work buffer it reallocates during a compute and a GPU
// backend a stream, so two sessions computing at once in two threads each need their own. The CPU's worker
// threads (`cpu_workers`) are the model's, n_threads of them shared by all its sessions, which take turns.
#pragma once

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace pdf {

// one buffer of type `buft` holding `tensors` (allocated in order, cleared to zero); nullptr when it cannot be had
ggml_backend_buffer_t alloc_tensors(ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor *> & tensors);

// A pool of CPU worker threads that runs one graph at a time, for whichever session's turn it is: sessions that
// compute at once queue for it, first come first served. Until sessions batch their evaluations, this is what
// keeps N parallel sessions from running N pools of n_threads on the same cores (each pool's workers spin at
// every op's barrier while another's hold the core: 4 sessions of 2 threads on 2 cores made 14 tokens/s where
// one session made 95). A session waits at most one graph of each session ahead of it.
class cpu_workers {
  public:
    explicit cpu_workers(int n_threads);  // throws backend_error when the threads cannot start
    ~cpu_workers();
    cpu_workers(const cpu_workers &)             = delete;
    cpu_workers & operator=(const cpu_workers &) = delete;

    ggml_threadpool_t pool() const { return pool_; }
    // runs `compute` (a graph compute on these workers) in this caller's turn, adding the ms it waited for the
    // turn to `waited_ms`
    template <typename F> ggml_status in_turn(double & waited_ms, F && compute) {
        const turn t(*this, waited_ms);
        return compute();
    }
    // the workers sleep now instead of polling for the next graph, unless a session is computing or waiting
    // (polling threads would take cores from other processes); the next compute wakes them
    void pause_if_idle();

  private:
    struct turn {  // held for one compute
        turn(cpu_workers & w, double & waited_ms);
        ~turn();
        cpu_workers & w;
    };
    ggml_threadpool_t       pool_ = nullptr;
    std::mutex              mutex_;
    std::condition_variable next_;
    uint64_t                issued_  = 0;  // tickets handed out
    uint64_t                serving_ = 0;  // the ticket whose turn it is
};

enum weight_use {
    WEIGHT_USE_MATMUL,    // right-hand side of ggml_mul_mat: may go to a repacking buffer type
    WEIGHT_USE_GET_ROWS,  // token embeddings: looked up by row
    WEIGHT_USE_OTHER,     // norms, biases, small vectors
};

class backends {
  public:
    // plan_only: for a memory plan (core/planned_buffer.h): every buffer is a planned one, layers may be placed
    // on a GPU this machine lacks, and only the CPU computes (graphs are measured, never run)
    backends(int n_threads, int n_gpu_layers, int n_layer, bool plan_only = false);
    ~backends();
    backends(const backends &)             = delete;
    backends & operator=(const backends &) = delete;
    // the n_gpu_layers a load honours: as asked, or 0 without a GPU device (a CPU-only build of pydflash, or its
    // GPU backend found no usable device or driver); a plan places layers as asked
    static int usable_gpu_layers(int n_gpu_layers);

    ggml_backend_dev_t cpu_device() const { return cpu_dev_; }
    // the GPU device sessions compute on when layers are offloaded to it, else nullptr (and in a plan)
    ggml_backend_dev_t gpu_device() const { return n_gpu_layers_ > 0 && !plan_only_ ? gpu_dev_ : nullptr; }
    int                n_threads() const { return n_threads_; }
    bool               plan_only() const { return plan_only_; }
    int                n_gpu_layers() const { return n_gpu_layers_; }  // of [0 .. n_layer], the head counted

    // true when layer `il` (-1 = input embeddings, n_layer = output head) runs on the GPU
    bool on_gpu(int il) const;
    // buffer type for a weight with the given use on layer `il`; `w` is a metadata tensor of its shape/type
    ggml_backend_buffer_type_t weight_buft(int il, weight_use use, ggml_tensor * w) const;
    // buffer type for per-session state (KV cache, recurrent state) of layer `il`
    ggml_backend_buffer_type_t state_buft(int il) const;
    // free bytes on the device that holds layer `il`'s state (system memory for the CPU; a plan: unbounded)
    size_t free_memory(int il) const;
    // the CPU workers the model's sessions share (started with the first session); nullptr when every layer is
    // on the GPU, where the CPU has next to nothing to do and each session keeps a pool of its own so that the
    // GPU's streams run the sessions' graphs at once
    std::shared_ptr<cpu_workers> shared_cpu_workers() const;

  private:
    ggml_backend_dev_t                      cpu_dev_ = nullptr;
    ggml_backend_dev_t                      gpu_dev_ = nullptr;
    std::vector<ggml_backend_buffer_type_t> cpu_extra_bufts_;
    int                                     n_threads_;
    int                                     n_layer_;
    int                                     n_gpu_layers_;
    bool                                    plan_only_;
    mutable std::mutex                      workers_mutex_;
    mutable std::shared_ptr<cpu_workers>    workers_;
};

// system memory available to this process (MemAvailable: free pages and reclaimable page cache)
size_t host_available_memory();

// bytes of buffers by the device holding them
struct device_bytes {
    size_t cpu = 0;
    size_t gpu = 0;
    size_t total() const { return cpu + gpu; }
};
device_bytes bytes_by_device(const std::vector<ggml_backend_buffer_t> & buffers);

class compute_backends {
  public:
    // instances of the devices `devices` uses, with its thread count; throws backend_error when one cannot start
    explicit compute_backends(const backends & devices);
    ~compute_backends();
    compute_backends(const compute_backends &)             = delete;
    compute_backends & operator=(const compute_backends &) = delete;

    ggml_backend_t cpu() const { return cpu_; }
    ggml_backend_t gpu() const { return gpu_; }  // nullptr without offloaded layers
    // a fresh scheduler over these backends (GPU first so it gets the work it can do)
    ggml_backend_sched_t new_sched(size_t graph_size) const;
    // a graph compute through `sched` (made by new_sched), or on one of these backends, in this session's turn
    // on the CPU workers
    ggml_status          compute(ggml_backend_sched_t sched, ggml_cgraph * gf) const;
    ggml_status          compute(ggml_backend_t backend, ggml_cgraph * gf) const;
    // the CPU workers sleep now instead of polling for the next graph (a generation ended: polling threads
    // would take cores from other work), unless another session is using them; the next compute wakes them
    void                 pause() const;
    // ms this session's computes have waited for their turn on the CPU workers (other sessions computing)
    double               waited_ms() const { return waited_ms_; }

  private:
    ggml_backend_t               cpu_ = nullptr;
    ggml_backend_t               gpu_ = nullptr;
    std::shared_ptr<cpu_workers> workers_;  // the CPU backend's worker threads (backends::shared_cpu_workers)
    mutable double               waited_ms_ = 0.0;
};

}  // namespace pdf
