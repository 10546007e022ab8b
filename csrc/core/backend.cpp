#include "core/backend.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"
#include "core/planned_buffer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sched.h>
#include <stdexcept>
#include <thread>
#include <unistd.h>

#include "ggml-alloc.h"

namespace pdf {

ggml_backend_buffer_t alloc_tensors(ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor *> & tensors) {
    size_t total = 0;
    for (ggml_tensor * t : tensors) {
        total += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), ggml_backend_buft_get_alignment(buft));
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, total);
    if (!buf) {
        return nullptr;
    }
    ggml_tallocr alloc = ggml_tallocr_new(buf);
    for (ggml_tensor * t : tensors) {
        ggml_tallocr_alloc(&alloc, t);
    }
    // zeroed: an empty state, and no NaN bits in masked-out cache rows that 0 * NaN would spread
    ggml_backend_buffer_clear(buf, 0);
    return buf;
}

// the cores this process may run on (its affinity mask: what taskset / a container's cpuset allow)
static int usable_cores() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
        return CPU_COUNT(&set);
    }
    return (int) std::max(1u, std::thread::hardware_concurrency());
}

// n_threads as asked (0: every usable core), at most the usable cores
static int thread_count(int n_threads) {
    if (n_threads < 0) {
        throw std::invalid_argument(format("n_threads = %d, expected 0 (all usable cores) or a positive count",
                                           n_threads));
    }
    // more threads than cores only make them wait on each other (and a huge count exhausts the OpenMP runtime)
    const int cores = usable_cores();
    if (n_threads > cores) {
        PDF_LOG_WARN("n_threads = %d exceeds the %d usable cores; using %d", n_threads, cores, cores);
    }
    return n_threads > 0 ? std::min(n_threads, cores) : cores;
}

backends::backends(int n_threads, int n_gpu_layers, int n_cpu_moe, const std::vector<float> & tensor_split,
                   int n_layer, bool plan_only)
    : tensor_split_(tensor_split), n_layer_(n_layer), n_cpu_moe_(n_cpu_moe < 0 ? n_layer : std::min(n_cpu_moe, n_layer)),
      plan_only_(plan_only) {
    n_threads_ = thread_count(n_threads);
    cpu_dev_   = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu_dev_) {
        throw backend_error("ggml has no CPU backend");
    }
    // the CPU's extra buffer types (weights repacked for faster matmul kernels)
    ggml_backend_reg_t cpu_reg = ggml_backend_dev_backend_reg(cpu_dev_);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        cpu_reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra) {
        for (ggml_backend_buffer_type_t * p = get_extra(cpu_dev_); p && *p; ++p) {
            // AMX tiles: its mul_mat segfaulted on the first batch on our 2-core Xeon (kernel AMX permission
            // granted, ggml 0.25.3), so we keep to the portable repacking buffer types
            if (strcmp(ggml_backend_buft_name(*p), "AMX") == 0) {
                continue;
            }
            cpu_extra_bufts_.push_back(*p);
        }
    }

    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        if (ggml_backend_dev_type(ggml_backend_dev_get(i)) == GGML_BACKEND_DEVICE_TYPE_GPU) {
            gpu_devs_.push_back(ggml_backend_dev_get(i));
        }
    }
    check_tensor_split();
    n_gpu_layers_ = layers_placed(plan_only ? n_gpu_layers : loadable_gpu_layers(n_gpu_layers));
    split_layers();
}

void backends::check_tensor_split() const {
    for (size_t d = 0; d < tensor_split_.size(); ++d) {
        if (!std::isfinite(tensor_split_[d]) || tensor_split_[d] < 0.0f) {
            throw std::invalid_argument(format("tensor_split[%zu] = %g, expected a finite proportion >= 0", d,
                                               (double) tensor_split_[d]));
        }
    }
    // a plan on a machine without the GPUs places its layers on one absent device: any split is the plan's
    if (!gpu_devs_.empty() && tensor_split_.size() > gpu_devs_.size()) {
        std::string names;
        for (ggml_backend_dev_t dev : gpu_devs_) {
            names += (names.empty() ? "" : ", ") + std::string(ggml_backend_dev_name(dev));
        }
        throw std::invalid_argument(format("tensor_split has %zu entries, expected at most one per GPU device (%zu: %s)",
                                           tensor_split_.size(), gpu_devs_.size(), names.c_str()));
    }
}

void backends::split_layers() {
    layer_device_.assign(n_layer_ + 2, -1);
    const int first = n_layer_ + 1 - n_gpu_layers_;  // the first offloaded layer
    if (n_gpu_layers_ == 0) {
        return;
    }
    if (gpu_devs_.empty()) {  // a plan's absent GPU
        std::fill(layer_device_.begin() + 1 + first, layer_device_.end(), 0);
        return;
    }
    const size_t n_dev = gpu_devs_.size();
    // each device's share: tensor_split when it has a non-zero entry, else the device's free memory
    std::vector<float> cum(n_dev, 0.0f);
    const bool given = std::any_of(tensor_split_.begin(), tensor_split_.end(), [](float v) { return v > 0.0f; });
    for (size_t d = 0; d < n_dev; ++d) {
        size_t free = 0, total = 0;
        if (!given) {
            ggml_backend_dev_memory(gpu_devs_[d], &free, &total);
        }
        const float share = given ? (d < tensor_split_.size() ? tensor_split_[d] : 0.0f) : (float) free;
        cum[d]            = share + (d > 0 ? cum[d - 1] : 0.0f);
    }
    for (float & c : cum) {
        c = cum.back() > 0.0f ? c / cum.back() : 1.0f;
    }
    // offloaded layer j goes to the first device whose cumulative share exceeds j / n_gpu_layers, in float as
    // llama.cpp computes it, so that both engines put the same layers on each device
    for (int j = 0; j < n_gpu_layers_; ++j) {
        const size_t d = std::upper_bound(cum.begin(), cum.end(), float(j) / float(n_gpu_layers_)) - cum.begin();
        layer_device_[1 + first + j] = (int) std::min(d, n_dev - 1);
    }
}

std::vector<ggml_backend_dev_t> backends::gpu_devices() const {
    std::vector<ggml_backend_dev_t> out;
    if (plan_only_) {
        return out;
    }
    for (size_t d = 0; d < gpu_devs_.size(); ++d) {
        if (std::find(layer_device_.begin(), layer_device_.end(), (int) d) != layer_device_.end()) {
            out.push_back(gpu_devs_[d]);
        }
    }
    return out;
}

ggml_backend_dev_t backends::device_of(int il) const {
    const int d = il + 1 >= 0 && il + 1 < (int) layer_device_.size() ? layer_device_[il + 1] : -1;
    return d >= 0 && d < (int) gpu_devs_.size() ? gpu_devs_[d] : nullptr;
}

int backends::layers_placed(int n_gpu_layers) const {
    // n_gpu_layers < 0 or > n_layer means everything, output head included
    return n_gpu_layers < 0 ? n_layer_ + 1 : std::min(n_gpu_layers, n_layer_ + 1);
}

int backends::loadable_gpu_layers(int n_gpu_layers) const {
    if (usable_gpu_layers(n_gpu_layers) != n_gpu_layers) {
        PDF_LOG_WARN("n_gpu_layers=%d ignored: no GPU device (a CPU-only build of pydflash, or its GPU backend "
                     "found no usable device or driver)", n_gpu_layers);
        return 0;
    }
    if (n_gpu_layers != 0) {
        // started once here so that a device that cannot start fails the load, not a later session
        for (ggml_backend_dev_t dev : gpu_devs_) {
            ggml_backend_t probe = ggml_backend_dev_init(dev, nullptr);
            if (!probe) {
                throw backend_error(format("could not initialise GPU device %s", ggml_backend_dev_name(dev)));
            }
            ggml_backend_free(probe);
        }
    }
    return n_gpu_layers;
}

void backends::realize(int n_threads, int n_gpu_layers, int n_cpu_moe, const std::vector<float> & tensor_split) {
    if (!plan_only_) {
        throw std::logic_error("backends::realize: these backends are a load's already");
    }
    const int placed = layers_placed(loadable_gpu_layers(n_gpu_layers));
    if (placed != n_gpu_layers_) {
        throw std::invalid_argument(format("n_gpu_layers = %d puts %d of the %d layers and head on the GPU here, but "
                                           "the plan placed %d", n_gpu_layers, placed, n_layer_ + 1, n_gpu_layers_));
    }
    const int cpu_moe = n_cpu_moe < 0 ? n_layer_ : std::min(n_cpu_moe, n_layer_);
    if (cpu_moe != n_cpu_moe_) {
        throw std::invalid_argument(format("n_cpu_moe = %d keeps the experts of %d layers on the CPU, but the plan "
                                           "kept %d", n_cpu_moe, cpu_moe, n_cpu_moe_));
    }
    if (tensor_split != tensor_split_) {
        auto listed = [](const std::vector<float> & v) {
            std::string out;
            for (float x : v) {
                out += (out.empty() ? "" : ", ") + format("%g", (double) x);
            }
            return "[" + out + "]";
        };
        throw std::invalid_argument(format("tensor_split = %s, but the plan split the layers by %s",
                                           listed(tensor_split).c_str(), listed(tensor_split_).c_str()));
    }
    n_threads_ = thread_count(n_threads);
    plan_only_ = false;
    const std::lock_guard<std::mutex> lock(threads_mutex_);
    threads_.reset();  // the plan's sessions' threads, of the plan's count
}

backends::~backends() = default;

int backends::usable_gpu_layers(int n_gpu_layers) {
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) ? n_gpu_layers : 0;
}

bool backends::on_gpu(int il) const {
    if (n_gpu_layers_ == 0 || il < 0) {
        return false;  // input embeddings stay on the CPU (row lookups), as in llama.cpp
    }
    // the last n_gpu_layers of [0 .. n_layer] (n_layer = output head) are offloaded
    return il >= n_layer_ + 1 - n_gpu_layers_;
}

static ggml_backend_buffer_type_t device_buft(ggml_backend_dev_t dev) {
    return dev ? ggml_backend_dev_buffer_type(dev) : nullptr;  // nullptr: a plan's absent GPU
}

// does `buft` hold `w` such that the device can run its matmul with it (ggml_mul_mat, or ggml_mul_mat_id for stacked
// experts)? (llama.cpp's weight_buft_supported; its expert probe routes each token to the model's top-k, where this
// one routes to one expert: the buffer types' checks read the weight's type and layout, not the number of slots)
static bool buft_supports_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, ggml_tensor * w,
                                 weight_use use) {
    ggml_init_params params = {ggml_tensor_overhead() * 8, nullptr, true};
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    w_copy = ggml_dup_tensor(ctx, w);
    ggml_tensor *    op     = nullptr;
    if (use == WEIGHT_USE_MATMUL_ID) {
        ggml_tensor * x   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], 1, 512);
        ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, 512);
        op                = ggml_mul_mat_id(ctx, w_copy, x, ids);
    } else {
        ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 512);
        op              = ggml_mul_mat(ctx, w_copy, x);
    }
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(buft, 0);
    w_copy->buffer              = dummy;
    bool ok                     = ggml_backend_dev_supports_op(dev, op);
    ggml_backend_buffer_free(dummy);
    ggml_free(ctx);
    return ok;
}

bool backends::weight_on_gpu(int il, weight_use use) const {
    return on_gpu(il) && !(use == WEIGHT_USE_MATMUL_ID && il < n_cpu_moe_);
}

ggml_backend_buffer_type_t backends::weight_buft(int il, weight_use use, ggml_tensor * w) const {
    ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
    const bool                 gpu  = weight_on_gpu(il, use);
    if (gpu) {
        buft = device_buft(device_of(il));
    } else if (use == WEIGHT_USE_MATMUL || use == WEIGHT_USE_MATMUL_ID) {
        for (ggml_backend_buffer_type_t extra : cpu_extra_bufts_) {
            if (buft_supports_matmul(cpu_dev_, extra, w, use)) {
                buft = extra;
                break;
            }
        }
    }
    return plan_only_ ? planned_buft(buft, gpu) : buft;
}

ggml_backend_buffer_type_t backends::state_buft(int il) const {
    ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
    if (on_gpu(il)) {
        buft = device_buft(device_of(il));
    }
    return plan_only_ ? planned_buft(buft, on_gpu(il)) : buft;
}

ggml_backend_buffer_type_t backends::host_state_buft() const {
    return plan_only_ ? planned_buft(ggml_backend_cpu_buffer_type(), false) : ggml_backend_cpu_buffer_type();
}

device_bytes bytes_by_device(const std::vector<ggml_backend_buffer_t> & buffers) {
    device_bytes n;
    for (ggml_backend_buffer_t b : buffers) {
        (buffer_on_gpu(b) ? n.gpu : n.cpu) += ggml_backend_buffer_get_size(b);
    }
    return n;
}

// A ggml thread pool of n_threads (the caller and n_threads - 1 workers), kept between graphs (without one ggml
// starts threads per graph). Not OpenMP's: its pools belong to the calling thread, and once more threads exist
// than cores libgomp stops spinning at the per-op barriers and each graph ran ~2x slower. Started paused: the
// first compute wakes it. Workers beyond a graph's n_threads sleep.
static ggml_threadpool_t start_pool(int n_threads) {
    ggml_threadpool_params params = ggml_threadpool_params_default(n_threads);
    params.paused                 = true;
    ggml_threadpool_t pool        = ggml_threadpool_new(&params);
    if (!pool) {
        throw backend_error(format("could not start a CPU thread pool of %d threads", n_threads));
    }
    return pool;
}

cpu_threads::cpu_threads(int n_threads) : pool_(start_pool(n_threads)), total_(n_threads), free_(n_threads) {}

cpu_threads::~cpu_threads() {
    ggml_threadpool_free(pool_);
}

void cpu_threads::pause_if_idle() {
    const std::lock_guard<std::mutex> lock(mutex_);  // no step takes threads while this holds it
    if (free_ == total_ && issued_ == serving_) {
        ggml_threadpool_pause(pool_);
    }
}

void cpu_threads::begin_generation() {
    const std::lock_guard<std::mutex> lock(mutex_);
    busy_++;
}

void cpu_threads::end_generation() {
    {
        const std::lock_guard<std::mutex> lock(mutex_);
        busy_--;
    }
    next_.notify_all();  // a waiting step's share may have grown
}

int cpu_threads::acquire(bool fair, double & waited_ms) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t               ticket = issued_++;
    int                          share  = 0;
    // a fair share is decided when the step's turn comes, by the sessions busy then (at least one: a step outside
    // any generation)
    auto ready = [&] {
        share = fair ? std::max(1, total_ / std::min(total_, std::max(1, busy_))) : total_;
        return serving_ == ticket && free_ >= share;
    };
    if (!ready()) {  // (no clock read when the threads are free)
        const auto t0 = clock_type::now();
        next_.wait(lock, ready);
        waited_ms += ms_since(t0);
    }
    free_ -= share;
    serving_++;
    lock.unlock();
    next_.notify_all();  // the next ticket may fit in what is left
    return share;
}

void cpu_threads::release(int share) {
    {
        const std::lock_guard<std::mutex> lock(mutex_);
        free_ += share;
    }
    next_.notify_all();
}

std::shared_ptr<cpu_threads> backends::shared_cpu_threads() const {
    if (n_gpu_layers_ == n_layer_ + 1 && !gpu_devices().empty()) {
        return nullptr;
    }
    const std::lock_guard<std::mutex> lock(threads_mutex_);
    if (!threads_) {
        threads_ = std::make_shared<cpu_threads>(n_threads_);
    }
    return threads_;
}

compute_backends::compute_backends(const backends & devices)
    : n_threads_(devices.n_threads()), shared_(devices.shared_cpu_threads()) {
    if (!shared_ || n_threads_ > 1) {  // (steps on fewer than all the threads, or every layer on the GPU)
        own_pool_ = start_pool(n_threads_);
    }
    cpu_ = ggml_backend_dev_init(devices.cpu_device(), nullptr);
    if (!cpu_) {
        free_own_pool();  // (a throwing constructor runs no destructor)
        throw backend_error("could not initialise the ggml CPU backend");
    }
    ggml_backend_cpu_set_n_threads(cpu_, n_threads_);  // (each step sets its threads and their pool)
    for (ggml_backend_dev_t dev : devices.gpu_devices()) {
        ggml_backend_t gpu = ggml_backend_dev_init(dev, nullptr);
        if (!gpu) {
            free_backends();  // (a throwing constructor runs no destructor)
            throw backend_error(format("could not initialise GPU device %s", ggml_backend_dev_name(dev)));
        }
        gpus_.push_back(gpu);
    }
}

void compute_backends::free_backends() {
    for (ggml_backend_t gpu : gpus_) {
        ggml_backend_free(gpu);
    }
    ggml_backend_free(cpu_);
    free_own_pool();
}

void compute_backends::free_own_pool() {
    if (own_pool_) {
        ggml_threadpool_free(own_pool_);
    }
}

compute_backends::~compute_backends() {
    free_backends();
}

void compute_backends::pause() const {
    if (own_pool_) {
        ggml_threadpool_pause(own_pool_);
    }
    if (shared_) {
        shared_->pause_if_idle();
    }
}

ggml_status compute_backends::compute(ggml_backend_sched_t sched, ggml_cgraph * gf) const {
    if (!trace_) {
        return in_step([&] { return ggml_backend_sched_graph_compute(sched, gf); });
    }
    ggml_backend_sched_set_eval_callback(sched, node_trace::observe, trace_.get());
    const ggml_status status = in_step([&] { return ggml_backend_sched_graph_compute(sched, gf); });
    ggml_backend_sched_set_eval_callback(sched, nullptr, nullptr);
    return status;
}

void compute_backends::trace_nodes(const std::string & prefix) {
    trace_ = prefix.empty() ? nullptr : std::make_unique<node_trace>(prefix);
}

std::map<std::string, traced_node> compute_backends::take_trace() const {
    return trace_ ? trace_->take() : std::map<std::string, traced_node>{};
}

ggml_status compute_backends::compute(ggml_backend_t backend, ggml_cgraph * gf) const {
    return in_step([&] { return ggml_backend_graph_compute(backend, gf); });
}

compute_backends::generation::generation(const compute_backends & c) : c_(c) {
    if (c_.shared_) {
        c_.shared_->begin_generation();
    }
}

compute_backends::generation::~generation() {
    if (c_.shared_) {
        c_.shared_->end_generation();
    }
}

namespace {
// The share of a model's CPU threads this thread holds. A step of other backends over the same model nested in it
// (a drafter with backends of its own, drafting for a session's round) computes on that share: waiting for more
// would wait for itself.
struct held_share {
    const cpu_threads * on      = nullptr;
    int                 threads = 0;
};
thread_local held_share held;
}  // namespace

compute_backends::step::step(const compute_backends & c, bool fair) : c_(c) {
    if (c_.steps_held_++ > 0) {
        return;
    }
    if (!c_.shared_) {
        c_.step_threads_ = c_.n_threads_;
    } else if (held.on == c_.shared_.get()) {
        c_.step_threads_ = held.threads;
    } else {
        c_.step_threads_ = c_.shared_->acquire(fair, c_.waited_ms_);
        held             = {c_.shared_.get(), c_.step_threads_};
        owner_           = true;
    }
    // all the model's threads: its pool, still polling from the last such step; fewer: this session's own
    const bool all = c_.shared_ && c_.step_threads_ == c_.shared_->n_threads();
    ggml_backend_cpu_set_threadpool(c_.cpu_, all ? c_.shared_->pool() : c_.own_pool_);
    ggml_backend_cpu_set_n_threads(c_.cpu_, c_.step_threads_);
}

compute_backends::step::~step() {
    if (--c_.steps_held_ > 0) {
        return;
    }
    if (owner_) {
        held = {};
        if (c_.step_threads_ < c_.shared_->n_threads()) {
            // its workers would poll for the next graph on cores another session's step may hold now
            ggml_threadpool_pause(c_.own_pool_);
        }
        c_.shared_->release(c_.step_threads_);
    }
    c_.step_threads_ = 0;
}

ggml_backend_sched_t compute_backends::new_sched(size_t graph_size) const {
    std::vector<ggml_backend_t> list(gpus_);
    list.push_back(cpu_);
    return ggml_backend_sched_new(list.data(), nullptr, (int) list.size(), graph_size, false, true);
}

size_t host_available_memory() {
    // MemAvailable counts reclaimable page cache, which free pages (sysconf) do not
    FILE * f = fopen("/proc/meminfo", "r");
    if (f) {
        char               line[256];
        unsigned long long kb = 0;
        while (fgets(line, sizeof(line), f)) {
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                fclose(f);
                return (size_t) kb * 1024;
            }
        }
        fclose(f);
    }
    long pages = sysconf(_SC_AVPHYS_PAGES);
    long page  = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (size_t) pages * (size_t) page : SIZE_MAX;
}

size_t backends::free_memory(int il) const {
    if (plan_only_) {
        return SIZE_MAX;  // what fits is the plan's answer, not the load's
    }
    size_t free = 0, total = 0;
    if (ggml_backend_dev_t dev = device_of(il)) {
        ggml_backend_dev_memory(dev, &free, &total);
        return free;
    }
    return host_available_memory();
}

}  // namespace pdf
