// Compute devices for one model: the CPU always, plus the first GPU device when ggml was built with one (CUDA,
// HIP, Vulkan, Metal ...). `backends` decides where each weight and each piece of session state lives
// (n_gpu_layers) and which buffer type holds it (the CPU's repacking buffer types for matmul weights, as
// llama.cpp does); it is shared, read-only, by every session over the model. `compute_backends` are the backend
// instances one session computes with: a CPU backend has a work buffer it reallocates during a compute and a GPU
// backend a stream, so two sessions computing at once in two threads each need their own. The CPU threads
// (`cpu_threads`) are the model's: n_threads of them, never more busy however many of its sessions compute.
#pragma once

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "core/node_trace.h"

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pdf {

// one buffer of type `buft` holding `tensors` (allocated in order, cleared to zero); nullptr when it cannot be had
ggml_backend_buffer_t alloc_tensors(ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor *> & tensors);

// The CPU threads a model's sessions share: n_threads in all (llama-server's -t), however many sessions decode.
// A session computes in steps (a decode round, a prefill micro-batch, or a lone graph), each on some of the
// threads, never more than n_threads busy in all; a step waits, first come first served, until what it asks for
// is free, and holds it through its host work too. It asks for
// - all of them: a step of many tokens (a prefill micro-batch, a speculative round's drafts and verify) keeps
//   every core busy on its own. On our 2-core VM two sessions verifying 16 drafts side by side on one thread
//   each took 1.5x the time of one after the other on both (each reads the weights for itself). Holding them
//   through the round's host work (the tree, auto's choice, the walk) kept it off the cores another session's
//   graph computes on: 4 auto sessions went from 0.79-0.91x one session's tokens/s (threads taken graph by
//   graph) to 0.88-1.17x.
// - a fair share: plain decoding of one token a step leaves the cores waiting on memory and on host work, so k
//   busy sessions each on n_threads / k threads (at least one) decode side by side: 4 plain sessions on 2
//   cores made 1.4-2.1x one session's tokens/s, where taking turns on both made 0.92-1.01x.
// Until sessions batch their evaluations, this is what keeps N parallel sessions off each other's cores: N pools
// of n_threads each on the same cores spin at every op's barrier while another's hold the core (4 sessions of 2
// threads on 2 cores made 14 tokens/s where one made 95).
class cpu_threads {
  public:
    explicit cpu_threads(int n_threads);  // throws backend_error when its pool cannot start
    ~cpu_threads();
    cpu_threads(const cpu_threads &)             = delete;
    cpu_threads & operator=(const cpu_threads &) = delete;
    int               n_threads() const { return total_; }
    // the pool a step on all the threads computes with, whichever session's: kept polling between such steps
    // (one session's and the next's), as it would between one session's graphs
    ggml_threadpool_t pool() const { return pool_; }
    // the pool sleeps now instead of polling for the next graph, unless a step holds threads or waits for them
    // (polling threads would take cores from other processes); the next compute wakes it
    void              pause_if_idle();

    // a session starts / ends a generation: the busy sessions the threads are divided among
    void begin_generation();
    void end_generation();
    // waits for this step's threads and takes them (adding the ms waited to `waited_ms`): all of them, or (fair)
    // n_threads / the busy sessions, at least one; returns how many
    int  acquire(bool fair, double & waited_ms);
    void release(int share);

  private:
    ggml_threadpool_t       pool_ = nullptr;
    int                     total_;
    int                     free_;
    int                     busy_ = 0;     // sessions generating (what a fair share divides by)
    std::mutex              mutex_;
    std::condition_variable next_;
    uint64_t                issued_  = 0;  // tickets handed out
    uint64_t                serving_ = 0;  // the ticket whose turn it is to take its share
};

enum weight_use {
    WEIGHT_USE_MATMUL,     // right-hand side of ggml_mul_mat: may go to a repacking buffer type
    WEIGHT_USE_MATMUL_ID,  // stacked experts [ne0, ne1, n_expert], first operand of ggml_mul_mat_id: likewise
    WEIGHT_USE_GET_ROWS,   // token embeddings: looked up by row
    WEIGHT_USE_OTHER,      // norms, biases, small vectors
};

class backends {
  public:
    // plan_only: for a memory plan (core/planned_buffer.h): every buffer is a planned one, layers may be placed
    // on a GPU this machine lacks, and only the CPU computes (graphs are measured, never run)
    // n_cpu_moe: the stacked experts (WEIGHT_USE_MATMUL_ID) of the first n_cpu_moe layers (-1: all) stay in system
    // memory, computed by the CPU, wherever their layer is placed (llama.cpp's --n-cpu-moe)
    // tensor_split: each GPU device's proportion of the offloaded layers, in device order (llama.cpp's
    // --tensor-split; devices past its end get none); empty or all zero: in proportion to free memory
    backends(int n_threads, int n_gpu_layers, int n_cpu_moe, const std::vector<float> & tensor_split, int n_layer,
             bool plan_only = false);
    ~backends();
    backends(const backends &)             = delete;
    backends & operator=(const backends &) = delete;
    // the n_gpu_layers a load honours: as asked, or 0 without a GPU device (a CPU-only build of pydflash, or its
    // GPU backend found no usable device or driver); a plan places layers as asked
    static int usable_gpu_layers(int n_gpu_layers);
    // a plan's backends become a load's, placing the layers where the plan did (refused, naming both, when
    // n_gpu_layers, n_cpu_moe or tensor_split places them elsewhere on this machine) and computing with
    // n_threads; the weights placed by them are then moved into real buffers (weights::realize). Only before any
    // session computes over them.
    void realize(int n_threads, int n_gpu_layers, int n_cpu_moe, const std::vector<float> & tensor_split);

    ggml_backend_dev_t cpu_device() const { return cpu_dev_; }
    // the GPU devices sessions compute on (those holding offloaded layers; none in a plan)
    std::vector<ggml_backend_dev_t> gpu_devices() const;
    // the GPU device holding layer `il` (-1: input embeddings, n_layer: output head), nullptr on the CPU or in a
    // plan without that device
    ggml_backend_dev_t device_of(int il) const;
    int                n_threads() const { return n_threads_; }
    bool               plan_only() const { return plan_only_; }
    int                n_gpu_layers() const { return n_gpu_layers_; }  // of [0 .. n_layer], the head counted
    bool               computes_on_gpu() const { return n_gpu_layers_ > 0; }  // (some layers on a GPU)
    int                n_cpu_moe() const { return n_cpu_moe_; }        // of [0 .. n_layer]: layers whose experts stay on the CPU
    const std::vector<float> & tensor_split() const { return tensor_split_; }

    // true when layer `il` (-1 = input embeddings, n_layer = output head) runs on the GPU
    bool on_gpu(int il) const;
    // true when a weight of layer `il` with this use is placed on the GPU (a layer's experts may stay on the CPU)
    bool weight_on_gpu(int il, weight_use use) const;
    // buffer type for a weight with the given use on layer `il`; `w` is a metadata tensor of its shape/type
    ggml_backend_buffer_type_t weight_buft(int il, weight_use use, ggml_tensor * w) const;
    // buffer type for per-session state (KV cache, recurrent state) of layer `il`
    ggml_backend_buffer_type_t state_buft(int il) const;
    // buffer type for per-session state kept in system memory wherever the layers are (copies read rarely)
    ggml_backend_buffer_type_t host_state_buft() const;
    // free bytes on the device that holds layer `il`'s state (system memory for the CPU; a plan: unbounded)
    size_t free_memory(int il) const;
    // the CPU threads the model's sessions share; nullptr when every layer is on the GPU, where the CPU has next
    // to nothing to do and each session computes on all of them so that the GPU's streams run the sessions'
    // graphs at once
    std::shared_ptr<cpu_threads> shared_cpu_threads() const;

  private:
    // n_gpu_layers as placed: the layers and head on the GPU, counted from the output end
    int layers_placed(int n_gpu_layers) const;
    // the offloaded layers over the GPU devices: consecutive runs in device order, in proportion to
    // tensor_split_ or else to each device's free memory (llama.cpp's split, its rounding too), the output head
    // on the last
    void split_layers();
    // tensor_split_ checked against the devices: finite, non-negative, at most one entry per GPU device
    void check_tensor_split() const;
    // n_gpu_layers a load honours on this machine (usable_gpu_layers, said in the log), its GPU started once
    int loadable_gpu_layers(int n_gpu_layers) const;

    ggml_backend_dev_t                      cpu_dev_ = nullptr;
    // every GPU-type device (local GPUs first, then RPC servers, in the registry's order); a plan on a machine
    // without one places its layers on one absent GPU (nullptr)
    std::vector<ggml_backend_dev_t>         gpu_devs_;
    std::vector<int>                        layer_device_;  // il + 1 -> index in gpu_devs_, or -1 (the CPU)
    std::vector<float>                      tensor_split_;  // as given (empty: by free memory)
    std::vector<ggml_backend_buffer_type_t> cpu_extra_bufts_;
    int                                     n_threads_;
    int                                     n_layer_;
    int                                     n_gpu_layers_;
    int                                     n_cpu_moe_;
    bool                                    plan_only_;
    mutable std::mutex                      threads_mutex_;
    mutable std::shared_ptr<cpu_threads>    threads_;
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

    ggml_backend_t                      cpu() const { return cpu_; }
    const std::vector<ggml_backend_t> & gpus() const { return gpus_; }  // none without offloaded layers
    // a fresh scheduler over these backends (GPU first so it gets the work it can do)
    ggml_backend_sched_t new_sched(size_t graph_size) const;
    // a graph compute through `sched` (made by new_sched), or on one of these backends: in this session's step,
    // or in a step of its own
    ggml_status          compute(ggml_backend_sched_t sched, ggml_cgraph * gf) const;
    ggml_status          compute(ggml_backend_t backend, ggml_cgraph * gf) const;
    // the CPU workers sleep now instead of polling for the next graph (a generation or a step ended: polling
    // threads would take cores from other work); the next compute wakes them
    void                 pause() const;
    // ms this session's steps have waited for their CPU threads (other sessions computing)
    double               waited_ms() const { return waited_ms_; }
    // from now on, the scheduled graphs' nodes whose names start with `prefix` are copied as they compute (empty:
    // no more); the copies are taken with take_trace (core/node_trace.h)
    void                               trace_nodes(const std::string & prefix);
    std::map<std::string, traced_node> take_trace() const;

    // This session generates (cpu_threads::begin_generation) while it lives: its steps share the threads with
    // the other busy sessions
    class generation {
      public:
        explicit generation(const compute_backends & c);
        ~generation();
        generation(const generation &)             = delete;
        generation & operator=(const generation &) = delete;

      private:
        const compute_backends & c_;
    };
    // One step of decoding on some of the CPU threads (a round: drafting, the verify, the walk and the commit;
    // or a prefill micro-batch): its graphs compute on them, and its host work runs on the thread that is one of
    // them. fair: a fair share (a plain decoding step), else all of them (cpu_threads). Steps nest; one
    // session's steps run on one thread at a time.
    class step {
      public:
        explicit step(const compute_backends & c, bool fair = false);
        ~step();
        step(const step &)             = delete;
        step & operator=(const step &) = delete;

      private:
        const compute_backends & c_;
        bool                     owner_ = false;  // it took the share (not nested in a step that holds it)
    };

  private:
    ggml_backend_t               cpu_ = nullptr;
    std::vector<ggml_backend_t>  gpus_;
    // this session's pool, for a step on fewer threads than the model's (its workers beyond the step's sleep),
    // or for every step with every layer on the GPU; nullptr on one thread, where every step takes them all
    ggml_threadpool_t            own_pool_ = nullptr;
    void                         free_own_pool();
    void                         free_backends();  // every backend and the pool
    int                          n_threads_ = 1;
    std::shared_ptr<cpu_threads> shared_;           // the model's (backends::shared_cpu_threads), or nullptr
    mutable double               waited_ms_    = 0.0;
    std::unique_ptr<node_trace>  trace_;
    mutable int                  steps_held_   = 0;  // nested steps
    mutable int                  step_threads_ = 0;  // the outermost step's threads (0: outside a step)
    template <typename F> ggml_status in_step(F && compute) const {
        const step s(*this);
        return compute();
    }
};

}  // namespace pdf
