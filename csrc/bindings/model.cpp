// The read-only weights: Model (a target) and DraftModel (a DFlash drafter for it), and the memory a process
// may use for them
#include "bindings/common.h"
#include "state/kv_cache.h"
#include "state/recurrent_state.h"

namespace pdf::bindings {

// a Python progress(done, total) callable as a load_progress (empty for None). It runs with the GIL released
// around it and takes it back for the call; it holds a handle, not an object, so that copying the std::function
// without the GIL touches no reference count (the callable must outlive the load).
static load_progress progress_callback(const py::object & progress) {
    if (progress.is_none()) {
        return {};
    }
    py::handle callback = progress;
    return [callback](size_t done, size_t total) {
        py::gil_scoped_acquire gil;
        callback(done, total);
    };
}

static py::list placement_list(const std::vector<weights::placed> & placed) {
    py::list out;
    for (const auto & p : placed) {
        out.append(py::make_tuple(p.name, p.on_gpu ? "gpu" : "cpu", p.buffer_type));
    }
    return out;
}

static delta_net_form parse_delta_net(const std::string & name) {
    if (name == "auto") {
        return delta_net_form::automatic;
    }
    if (name == "fused") {
        return delta_net_form::fused;
    }
    if (name == "chunked") {
        return delta_net_form::chunked;
    }
    throw std::invalid_argument(format("delta_net = '%s', expected 'auto', 'fused' or 'chunked'", name.c_str()));
}

static model_params load_params(int64_t n_gpu_layers, int64_t n_cpu_moe, const std::vector<float> & tensor_split,
                                int64_t n_threads, const py::object & progress, const std::string & delta_net) {
    model_params p;
    p.tensor_split = tensor_split;
    p.n_gpu_layers = (int) checked("n_gpu_layers", n_gpu_layers, -1, INT32_MAX);
    p.n_cpu_moe    = (int) checked("n_cpu_moe", n_cpu_moe, -1, INT32_MAX);
    p.n_threads    = (int) checked("n_threads", n_threads, 0, INT32_MAX);
    p.progress     = progress_callback(progress);
    p.delta_net    = parse_delta_net(delta_net);
    return p;
}

static py_model load_model(const std::string & path, int64_t n_gpu_layers, int64_t n_cpu_moe,
                           const std::vector<float> & tensor_split, int64_t n_threads, py::object progress,
                           bool plan_only, const std::string & delta_net) {
    model_params p = load_params(n_gpu_layers, n_cpu_moe, tensor_split, n_threads, progress, delta_net);
    p.plan_only    = plan_only;
    std::shared_ptr<target_model> loaded;
    {
        py::gil_scoped_release nogil;
        loaded = load_target_model(path, p);
    }
    return py_model{loaded, plan_only ? loaded : nullptr};
}

// a plan's Model (plan_only) becomes a load's: the one model object, built once (target_model::realize)
static void load_planned_weights(py_model & m, int64_t n_gpu_layers, int64_t n_cpu_moe,
                                 const std::vector<float> & tensor_split, int64_t n_threads, py::object progress,
                                 const std::string & delta_net) {
    if (!m.planned) {
        throw std::invalid_argument(format("%s: the weights are loaded already (load_weights is for a Model made "
                                           "with plan_only=True)", m.model->info().path.c_str()));
    }
    const model_params p = load_params(n_gpu_layers, n_cpu_moe, tensor_split, n_threads, progress, delta_net);
    {
        py::gil_scoped_release nogil;
        m.planned->realize(p);
    }
    m.planned.reset();
}

// the GPU-type devices together (offloaded layers are split over all of them: backends::split_layers)
static py::dict device_memory() {
    py::dict out;
    out["cpu_free"] = host_available_memory();
    std::string names;
    size_t      gpu_free = 0, gpu_total = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU) {
            continue;
        }
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        names += (names.empty() ? "" : ", ") + std::string(ggml_backend_dev_name(dev)) + " (" +
                 ggml_backend_dev_description(dev) + ")";
        gpu_free += free;
        gpu_total += total;
    }
    if (!names.empty()) {
        out["gpu_name"]  = names;
        out["gpu_free"]  = gpu_free;
        out["gpu_total"] = gpu_total;
    }
    return out;
}

static void register_target(py::module_ & m) {
    py::class_<py_model>(m, "Model")
        .def(py::init(&load_model),
             py::arg("path"), py::arg("n_gpu_layers") = 0, py::arg("n_cpu_moe") = 0,
             py::arg("tensor_split") = std::vector<float>(), py::arg("n_threads") = 0,
             py::arg("progress") = py::none(), py::arg("plan_only") = false, py::arg("delta_net") = "auto",
             "n_cpu_moe: the experts of the first n layers (-1: all) stay in system memory and are computed by the "
             "CPU, wherever n_gpu_layers puts their layer (llama.cpp's --n-cpu-moe). tensor_split: each GPU "
             "device's proportion of the offloaded layers, in device order (llama.cpp's --tensor-split; empty or all "
             "zero: in proportion to free memory). progress: called as progress(bytes read, bytes in all) while the weights load. plan_only: for a memory "
             "plan (pydflash.plan): the GGUF's metadata only, buffers that reserve address space only, layers "
             "placeable on a GPU this machine lacks; sessions over it measure graphs and cannot run them. delta_net "
             "(hybrid targets): how prefill micro-batches run the delta rule: 'fused' (ggml_gated_delta_net), "
             "'chunked' (stock ops, models/delta_net.h) or 'auto' (fused where the backend has the op).")
        .def("load_weights", &load_planned_weights, py::arg("n_gpu_layers") = 0, py::arg("n_cpu_moe") = 0,
             py::arg("tensor_split") = std::vector<float>(), py::arg("n_threads") = 0, py::arg("progress") = py::none(), py::arg("delta_net") = "auto",
             "A plan's Model (plan_only=True) becomes a loaded one, its layers where the plan placed them (an error "
             "when n_gpu_layers, n_cpu_moe or tensor_split places them elsewhere here): the weights move into real buffers and are read. "
             "Sessions opened over the plan must be gone; a DraftModel over it loads its own after this.")
        .def_property_readonly("plan_only", [](const py_model & m) { return m.model->devices().plan_only(); })
        .def_property_readonly("n_gpu_layers", [](const py_model & m) { return m.model->devices().n_gpu_layers(); },
                               "Layers of [0 .. n_layer] on the GPU (the output head counts as layer n_layer).")
        .def_property_readonly("n_cpu_moe", [](const py_model & m) { return m.model->devices().n_cpu_moe(); },
                               "Layers (the first ones) whose experts stay in system memory.")
        .def_property_readonly("tensor_split", [](const py_model & m) { return m.model->devices().tensor_split(); },
                               "The offloaded layers' proportions per GPU device, as given (empty: by free memory).")
        .def_property_readonly("weight_memory", [](const py_model & m) { return as_pair(m.model->weight_memory()); },
                               "(CPU bytes, GPU bytes) of the weight buffers.")
        .def_property_readonly("expert_memory", [](const py_model & m) { return as_pair(m.model->expert_memory()); },
                               "(CPU bytes, GPU bytes) of the stacked experts, part of weight_memory (MoE targets).")
        .def_property_readonly("placement",
                               [](const py_model & m) { return placement_list(m.model->weight_placement()); },
                               "Where each weight went: [(tensor name, 'cpu' or 'gpu', buffer type name)] (a tied "
                               "head's copy is listed under token_embd.weight too).")
        .def_property_readonly("arch", [](const py_model & m) { return m.model->info().arch; })
        .def_property_readonly("n_vocab", [](const py_model & m) { return m.model->info().n_vocab; })
        .def_property_readonly("n_embd", [](const py_model & m) { return m.model->info().n_embd; })
        .def_property_readonly("n_layer", [](const py_model & m) { return m.model->info().n_layer; })
        .def_property_readonly("n_ctx_train", [](const py_model & m) { return m.model->info().n_ctx_train; })
        .def_property_readonly("n_threads", [](const py_model & m) { return m.model->devices().n_threads(); })
        .def_property_readonly("weight_bytes", [](const py_model & m) { return m.model->weight_bytes(); })
        .def_property_readonly("is_recurrent", [](const py_model & m) { return !m.model->info().recurrent_layers.empty(); })
        .def("recurrent_bytes_for", [](const py_model & m, int64_t n_rollback) {
            checked("n_rollback", n_rollback, 1, MAX_ROLLBACK);
            return m.model->info().recurrent_layers.empty()
                       ? 0
                       : recurrent_state::n_bytes_for(m.model->info(), (uint32_t) n_rollback);
        }, py::arg("n_rollback"), "Bytes of the recurrent state that keeps n_rollback per-token (or per-node) states.")
        .def("kv_bytes_for", [](const py_model & m, int64_t n_ctx, const std::string & tk, const std::string & tv) {
            checked("n_ctx", n_ctx, 1, MAX_CTX);
            return kv_cache::n_bytes_for(m.model->info(), (uint32_t) n_ctx, parse_kv_type(tk), parse_kv_type(tv));
        });
}

static void register_draft_model(py::module_ & m) {
    py::class_<py_draft_model>(m, "DraftModel")
        .def(py::init([](const py_model & target, const std::string & path, py::object progress) {
                 const load_progress on_progress = progress_callback(progress);
                 py::gil_scoped_release nogil;
                 auto draft = std::make_shared<dflash_draft>(path, target.model, on_progress);
                 return py_draft_model{draft, target.model->devices().plan_only() ? draft : nullptr};
             }),
             py::arg("target"), py::arg("path"), py::arg("progress") = py::none(), py::keep_alive<1, 2>(),
             "DFlash draft weights for `target`, to share between DraftSessions (one per target session).")
        .def("load_weights", [](py_draft_model & d, py::object progress) {
                 if (!d.planned) {
                     throw std::invalid_argument(format("%s: the weights are loaded already (load_weights is for a "
                                                        "plan's DraftModel)", d.model->info().path.c_str()));
                 }
                 const load_progress on_progress = progress_callback(progress);
                 {
                     py::gil_scoped_release nogil;
                     d.planned->realize(on_progress);
                 }
                 d.planned.reset();
             }, py::arg("progress") = py::none(),
             "A plan's DraftModel becomes a loaded one, after its target Model's load_weights.")
        .def_property_readonly("block_size", [](const py_draft_model & d) { return d.model->block_size(); })
        .def_property_readonly("weight_bytes", [](const py_draft_model & d) { return d.model->weight_bytes(); })
        .def_property_readonly("weight_memory",
                               [](const py_draft_model & d) { return as_pair(d.model->weight_memory()); })
        .def_property_readonly("placement", [](const py_draft_model & d) {
            return placement_list(d.model->weight_placement());
        });
}

void register_model(py::module_ & m) {
    m.def("usable_gpu_layers", [](int64_t n) { return backends::usable_gpu_layers((int) checked("n_gpu_layers", n, -1, INT32_MAX)); },
          py::arg("n_gpu_layers"),
          "The n_gpu_layers a load honours: as asked, or 0 on a machine without a GPU device (a plan places layers "
          "as asked, on a GPU this machine may lack).");
    m.def("device_memory", &device_memory,
          "Memory this process may use: the system's available bytes, and the GPU devices' free and total bytes "
          "together, the devices named (keys absent without a GPU; RPC servers count as GPUs).");
    register_target(m);
    register_draft_model(m);
}

}  // namespace pdf::bindings
