// pydflash._core: the one pybind11 module. Coarse calls only; the decode loop runs in C++ with the GIL
// released. C++ errors become the classes of pydflash.errors.
#include "core/error.h"
#include "core/gguf_file.h"
#include "core/log.h"
#include "core/quantize.h"
#include "models/argmax.h"
#include "models/model.h"
#include "decode/driver.h"
#include "decode/sampler.h"
#include "decode/proposer.h"
#include "state/draft_session.h"
#include "state/session.h"

#include "ggml-rpc.h"

#ifndef _WIN32
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <algorithm>
#include <map>

namespace py = pybind11;
using namespace pdf;

// the largest context a session accepts: positions are int32, and windows are padded beyond them
static constexpr int64_t MAX_CTX = 1 << 30;
// the most per-token (or per-node) recurrent states a session keeps for rollback
static constexpr int64_t MAX_ROLLBACK = 1 << 16;

// Integer arguments arrive as int64 (pybind refuses floats and None with a TypeError) and are range-checked
// here, naming the parameter, before they are narrowed.
static int64_t checked(const char * name, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi) {
        throw std::invalid_argument(format("%s = %lld, expected a value in [%lld, %lld]", name, (long long) v,
                                           (long long) lo, (long long) hi));
    }
    return v;
}

// a 1-D array of token ids / positions: integers (a float array is refused, not truncated) that fit int32
static std::vector<int32_t> int32_array(const char * name, const py::handle & o) {
    py::array a = py::array::ensure(o);
    if (!a || a.ndim() != 1 || (a.size() > 0 && a.dtype().kind() != 'i' && a.dtype().kind() != 'u')) {
        throw py::type_error(format("%s must be a 1-D sequence of integers", name));
    }
    if (a.dtype().kind() == 'u') {  // (uint64 values above INT64_MAX would wrap to negatives in the int64 cast)
        py::array_t<uint64_t, py::array::c_style | py::array::forcecast> u(a);
        for (py::ssize_t i = 0; i < u.size(); ++i) {
            if (u.data()[i] > (uint64_t) INT32_MAX) {
                throw std::invalid_argument(format("%s = %llu, expected a value in [%d, %d]", name,
                                                   (unsigned long long) u.data()[i], INT32_MIN, INT32_MAX));
            }
        }
    }
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> wide(a);
    std::vector<int32_t> out(wide.size());
    for (py::ssize_t i = 0; i < wide.size(); ++i) {
        out[i] = (int32_t) checked(name, wide.data()[i], INT32_MIN, INT32_MAX);
    }
    return out;
}

static ggml_type parse_kv_type(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name((ggml_type) t);
        if (tn && name == tn) {
            return (ggml_type) t;
        }
    }
    throw std::invalid_argument("unknown kv_type '" + name + "' (expected f32, f16, bf16, q8_0, q4_0, ...)");
}

static void register_errors(py::module_ & m) {
    py::module_ errors = py::module_::import("pydflash.errors");
    static py::object py_format_error      = errors.attr("GGUFFormatError");
    static py::object py_unsupported_error = errors.attr("UnsupportedModelError");
    static py::object py_file_error        = errors.attr("ModelLoadError");
    static py::object py_ctx_error         = errors.attr("ContextLengthExceededError");
    static py::object py_backend_error     = errors.attr("BackendError");
    static py::object py_error             = errors.attr("PydflashError");
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const format_error & e) {
            PyErr_SetString(py_format_error.ptr(), e.what());
        } catch (const unsupported_error & e) {
            PyErr_SetString(py_unsupported_error.ptr(), e.what());
        } catch (const file_error & e) {
            PyErr_SetString(py_file_error.ptr(), e.what());
        } catch (const context_overflow_error & e) {
            py::object exc = py_ctx_error(e.what(), e.n_tokens, e.n_ctx);
            PyErr_SetObject(py_ctx_error.ptr(), exc.ptr());
        } catch (const backend_error & e) {
            PyErr_SetString(py_backend_error.ptr(), e.what());
        } catch (const pdf::error & e) {
            PyErr_SetString(py_error.ptr(), e.what());
        }
    });
    (void) m;
}

// element i of an array key, or the scalar value of a key (GGUF stores both as plain little-endian data)
template <typename T> static T gguf_number(const gguf_context * g, int64_t id, size_t i, bool array) {
    const void * data = array ? gguf_get_arr_data(g, id) : gguf_get_val_data(g, id);
    return ((const T *) data)[array ? i : 0];
}

// value of one GGUF key (or array element) as a Python object
static py::object gguf_value(const gguf_context * g, int64_t id, gguf_type t, size_t i, bool array) {
    switch (t) {
        case GGUF_TYPE_UINT8:   return py::int_(gguf_number<uint8_t>(g, id, i, array));
        case GGUF_TYPE_INT8:    return py::int_(gguf_number<int8_t>(g, id, i, array));
        case GGUF_TYPE_UINT16:  return py::int_(gguf_number<uint16_t>(g, id, i, array));
        case GGUF_TYPE_INT16:   return py::int_(gguf_number<int16_t>(g, id, i, array));
        case GGUF_TYPE_UINT32:  return py::int_(gguf_number<uint32_t>(g, id, i, array));
        case GGUF_TYPE_INT32:   return py::int_(gguf_number<int32_t>(g, id, i, array));
        case GGUF_TYPE_UINT64:  return py::int_(gguf_number<uint64_t>(g, id, i, array));
        case GGUF_TYPE_INT64:   return py::int_(gguf_number<int64_t>(g, id, i, array));
        case GGUF_TYPE_FLOAT32: return py::float_(gguf_number<float>(g, id, i, array));
        case GGUF_TYPE_FLOAT64: return py::float_(gguf_number<double>(g, id, i, array));
        case GGUF_TYPE_BOOL:    return py::bool_(gguf_number<int8_t>(g, id, i, array) != 0);
        case GGUF_TYPE_STRING: {
            const char * s = array ? gguf_get_arr_str(g, id, i) : gguf_get_val_str(g, id);
            // surrogateescape: a vocabulary entry that is not valid UTF-8 still round-trips to its bytes
            PyObject * o = PyUnicode_DecodeUTF8(s, (Py_ssize_t) strlen(s), "surrogateescape");
            if (!o) {
                throw py::error_already_set();
            }
            return py::reinterpret_steal<py::object>(o);
        }
        default:                return py::none();
    }
}

static std::string type_name(const py::handle & o) {
    return py::str(py::type::of(o).attr("__name__")).cast<std::string>();
}

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

// Model: the read-only weights, shareable between sessions
struct py_model {
    std::shared_ptr<const target_model> model;
};

// DFlash draft weights, loaded once and shared by the draft sessions of every target session over its target
struct py_draft_model {
    std::shared_ptr<const dflash_draft> model;
};

// A drafter for one target session, with what the decode loop learns about it on this machine (costs, how far
// its probabilities can be trusted), kept across generate calls
struct py_draft {
    std::unique_ptr<draft_session>     session;
    std::unique_ptr<speculation_state> state;
};

// sampling parameters from a dict with llama-cpp-python's names (None or {}: greedy); unknown keys are an error
static sampling_params parse_sampling(const py::object & o) {
    sampling_params p;
    if (o.is_none()) {
        return p;
    }
    const auto number = [](const char * name, const py::handle & v) {
        if (!py::isinstance<py::float_>(v) && !py::isinstance<py::int_>(v)) {
            throw py::type_error(format("%s must be a number", name));
        }
        return v.cast<double>();
    };
    const auto integer = [](const char * name, const py::handle & v, int64_t lo, int64_t hi) {
        if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v)) {
            throw py::type_error(format("%s must be an int", name));
        }
        return checked(name, v.cast<int64_t>(), lo, hi);
    };
    for (const auto & [key_h, v] : o.cast<py::dict>()) {
        const std::string key = key_h.cast<std::string>();
        if (key == "temperature") {
            p.temperature = (float) number("temperature", v);
        } else if (key == "top_k") {
            p.top_k = (int) integer("top_k", v, INT32_MIN, INT32_MAX);
        } else if (key == "top_p") {
            p.top_p = (float) number("top_p", v);
        } else if (key == "min_p") {
            p.min_p = (float) number("min_p", v);
        } else if (key == "typical_p") {
            p.typical_p = (float) number("typical_p", v);
        } else if (key == "repeat_penalty") {
            p.repeat_penalty = (float) number("repeat_penalty", v);
        } else if (key == "presence_penalty") {
            p.presence_penalty = (float) number("presence_penalty", v);
        } else if (key == "frequency_penalty") {
            p.frequency_penalty = (float) number("frequency_penalty", v);
        } else if (key == "repeat_last_n") {
            p.repeat_last_n = (int) integer("repeat_last_n", v, INT32_MIN, INT32_MAX);
        } else if (key == "seed") {
            if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v)) {
                throw py::type_error("seed must be an int");
            }
            p.seed = py::reinterpret_borrow<py::int_>(v).attr("__and__")(py::int_(UINT64_MAX)).cast<uint64_t>();
        } else if (key == "logprobs") {
            p.n_logprobs = v.is_none() ? -1 : (int) integer("logprobs", v, 0, INT32_MAX);
        } else if (key == "logit_bias") {
            for (const auto & [id, bias] : v.cast<py::dict>()) {
                const int32_t tok = (int32_t) integer("logit_bias key", id, 0, INT32_MAX);
                p.logit_bias.emplace_back(tok, (float) number("logit_bias value", bias));
            }
        } else {
            throw std::invalid_argument("unknown sampling parameter '" + key + "'");
        }
    }
    return p;
}

static py::dict logprobs_dict(const std::vector<token_logprobs> & lps) {
    py::list token_lp, top;
    for (const token_logprobs & lp : lps) {
        token_lp.append(lp.logprob);
        py::list alternatives;
        for (const auto & [id, v] : lp.top) {
            alternatives.append(py::make_tuple(id, v));
        }
        top.append(alternatives);
    }
    py::dict d;
    d["token_logprobs"] = token_lp;
    d["top_logprobs"]   = top;
    return d;
}

static spec_mode parse_spec_mode(const std::string & name) {
    if (name == "auto") {
        return spec_mode::automatic;
    }
    if (name == "tree") {
        return spec_mode::tree;
    }
    if (name == "chain") {
        return spec_mode::chain;
    }
    throw std::invalid_argument("spec_mode = '" + name + "' is not one of 'auto', 'tree', 'chain'");
}

static tree_seed parse_tree_seed(const std::string & name) {
    if (name == "chain") {
        return tree_seed::chain;
    }
    if (name == "best_first") {
        return tree_seed::best_first;
    }
    throw std::invalid_argument("tree_seed = '" + name + "' is not one of 'chain', 'best_first'");
}

static py::dict timings_dict(const generate_timings & t, bool speculative, const auto_stats * a) {
    py::dict d;
    d["prompt_n"]       = t.prompt_n;
    d["cached_n"]       = t.cached_n;
    d["prompt_ms"]      = t.prompt_ms;
    d["predicted_n"]    = t.predicted_n;
    d["predicted_ms"]   = t.predicted_ms;
    d["n_target_evals"] = t.n_target_evals;
    d["sample_ms"]      = t.sample_ms;
    if (speculative) {
        d["draft_n"]          = t.draft_n;
        d["draft_n_accepted"] = t.draft_n_accepted;
        d["n_rounds"]         = t.n_rounds;
        d["verify_n"]         = t.verify_n;
        d["draft_ms"]         = t.draft_ms;
        d["verify_ms"]        = t.verify_ms;
        d["accepted_at"]      = t.accepted_at;
        d["proposed_at"]      = t.proposed_at;
        if (a) {
            d["auto_skipped"] = a->n_skipped;
            d["auto_plain"]   = a->n_plain;
            d["auto_chain"]   = a->n_chain;
            d["auto_tree"]    = a->n_tree;
        }
    }
    return d;
}

// rows [first, first + n) of a 2-D state tensor, as raw bytes [n, row bytes]
static py::array_t<uint8_t> tensor_rows(const ggml_tensor * t, int64_t first, int64_t n) {
    py::array_t<uint8_t> out({(py::ssize_t) n, (py::ssize_t) t->nb[1]});
    ggml_backend_tensor_get(t, out.mutable_data(), (size_t) first * t->nb[1], (size_t) n * t->nb[1]);
    return out;
}

static py::array_t<float> f32_rows(const ggml_tensor * t, const std::vector<int32_t> & rows) {
    py::array_t<float> out({(py::ssize_t) rows.size(), (py::ssize_t) t->ne[0]});
    for (size_t i = 0; i < rows.size(); ++i) {
        ggml_backend_tensor_get(t, out.mutable_data() + i * t->ne[0], (size_t) rows[i] * t->nb[1], t->nb[1]);
    }
    return out;
}

// (CPU bytes, GPU bytes)
static std::pair<size_t, size_t> as_pair(const device_bytes & n) {
    return {n.cpu, n.gpu};
}

static py::list placement_list(const std::vector<weights::placed> & placed) {
    py::list out;
    for (const auto & p : placed) {
        out.append(py::make_tuple(p.name, p.on_gpu ? "gpu" : "cpu", p.buffer_type));
    }
    return out;
}

// Connects to host:port and closes, raising ConnectionError (ValueError for a malformed endpoint) where that fails.
static void probe_tcp_endpoint(const std::string & endpoint) {
    const size_t colon = endpoint.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == endpoint.size()) {
        throw py::value_error(format("RPC endpoint '%s': expected host:port", endpoint.c_str()));
    }
#ifndef _WIN32  // (elsewhere ggml's client is left to say it)
    const std::string host = endpoint.substr(0, colon), port = endpoint.substr(colon + 1);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * found  = nullptr;
    bool       reached = false;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) == 0) {
        for (addrinfo * a = found; a && !reached; a = a->ai_next) {
            const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
            if (fd >= 0) {
                reached = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
                close(fd);
            }
        }
        freeaddrinfo(found);
    }
    if (!reached) {
        const std::string msg = format("could not connect to the RPC server at %s", endpoint.c_str());
        PyErr_SetString(PyExc_ConnectionError, msg.c_str());
        throw py::error_already_set();
    }
#endif
}

PYBIND11_MODULE(_core, m, py::mod_gil_not_used()) {
    m.doc() = "pydflash core (C++/ggml); use the pydflash package, not this module";
    register_errors(m);
    log_set_callback(nullptr);  // ggml's log goes through our sink (warnings to stderr) until Python sets one

    m.def("set_log_callback", [](py::object cb) {
        if (cb.is_none()) {
            log_set_callback(nullptr);
            return;
        }
        auto keep = std::make_shared<py::object>(cb);
        log_set_callback([keep](log_level level, const std::string & text) {
            py::gil_scoped_acquire gil;
            try {
                (*keep)((int) level, text);
            } catch (py::error_already_set & e) {
                e.discard_as_unraisable("pydflash log callback");
            }
        });
    });

    m.def(
        "gguf_metadata",
        [](const std::string & path, const std::vector<std::string> & keys) {
            // ggml's gguf parser; {key: (gguf type, element type or None, value)} for the keys present
            std::unique_ptr<gguf_file> file;
            {
                py::gil_scoped_release nogil;
                file = std::make_unique<gguf_file>(path);
            }
            const gguf_context * g = file->metadata();
            py::dict out;
            for (const std::string & key : keys) {
                const int64_t id = gguf_find_key(g, key.c_str());
                if (id < 0) {
                    continue;
                }
                const gguf_type t = gguf_get_kv_type(g, id);
                if (t != GGUF_TYPE_ARRAY) {
                    out[py::str(key)] = py::make_tuple((int) t, py::none(), gguf_value(g, id, t, 0, false));
                    continue;
                }
                const gguf_type at = gguf_get_arr_type(g, id);
                const size_t    n  = gguf_get_arr_n(g, id);
                py::list        values(n);
                for (size_t i = 0; i < n; ++i) {
                    values[i] = gguf_value(g, id, at, i, true);
                }
                out[py::str(key)] = py::make_tuple((int) t, (int) at, values);
            }
            return out;
        },
        py::arg("path"), py::arg("keys"), "Read metadata keys of a GGUF file with ggml's gguf parser.");
    m.def("ggml_type_id", &parse_kv_type, py::arg("name"));
    m.def("quantized_row_size", [](int64_t type, int64_t n_per_row) {
        return quantized_row_size((ggml_type) checked("type", type, 0, GGML_TYPE_COUNT - 1), n_per_row);
    });
    m.def(
        "quantize",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> data, int64_t type) {
            checked("type", type, 0, GGML_TYPE_COUNT - 1);
            if (data.ndim() != 2) {
                throw std::invalid_argument("quantize: data must be 2-D (n_rows, n_per_row)");
            }
            const int64_t n_rows = data.shape(0), n_per_row = data.shape(1);
            const size_t  row    = quantized_row_size((ggml_type) type, n_per_row);
            py::array_t<uint8_t> out({(py::ssize_t) n_rows, (py::ssize_t) row});
            const float * src = data.data();
            uint8_t *     dst = out.mutable_data();
            {
                py::gil_scoped_release nogil;
                quantize_rows((ggml_type) type, src, dst, n_rows, n_per_row);
            }
            return out;
        },
        py::arg("data"), py::arg("type"), "Quantize float32 rows with ggml's quantizer; returns uint8 (n_rows, row_bytes).");

    m.def(
        "argmax_rows",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, int64_t n_threads, bool stock) {
            checked("n_threads", n_threads, 1, 1 << 12);
            if (logits.ndim() != 2) {
                throw std::invalid_argument("argmax_rows: logits must be 2-D (n_rows, n_vocab)");
            }
            const float * data = logits.data();
            std::vector<int32_t> out;
            {
                py::gil_scoped_release nogil;
                out = argmax_rows_on_cpu(data, logits.shape(0), logits.shape(1), (int) n_threads, stock);
            }
            return out;
        },
        py::arg("logits"), py::arg("n_threads"), py::arg("stock") = false,
        "The greedy pick of the CPU graphs (stock=True: ggml_argmax) on a float32 (n_rows, n_vocab) array.");

    m.def(
        "build_draft_tree",
        [](py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
           py::array_t<float, py::array::c_style | py::array::forcecast> logprobs, int64_t root, int64_t budget,
           int64_t max_depth, const std::string & seed) {
            checked("root", root, 0, INT32_MAX);
            checked("budget", budget, 0, 1 << 16);
            checked("max_depth", max_depth, 0, 1 << 16);
            // ids, logprobs: [positions, k], most likely first per position
            if (ids.ndim() != 2 || logprobs.ndim() != 2 || ids.shape(0) != logprobs.shape(0) ||
                ids.shape(1) != logprobs.shape(1) || ids.shape(1) < 1) {
                throw std::invalid_argument("build_draft_tree: ids and logprobs must both be (positions, k >= 1)");
            }
            draft_proposals p;
            p.n_positions = (int) ids.shape(0);
            p.top_k       = (int) ids.shape(1);
            p.ids.assign(ids.data(), ids.data() + ids.size());
            p.logprobs.assign(logprobs.data(), logprobs.data() + logprobs.size());
            draft_tree t;
            build_draft_tree(p, (int32_t) root, (int) budget, (int) max_depth, parse_tree_seed(seed), t);
            return py::make_tuple(t.tokens, t.parents, t.depth, t.logq);
        },
        py::arg("ids"), py::arg("logprobs"), py::arg("root"), py::arg("budget"), py::arg("max_depth"),
        py::arg("seed") = "best_first",
        "The DDTree tree the loop verifies: (tokens, parents, depth, log Q) of [root, nodes...] in choice order.");

    m.def(
        "choose_verify_budget",
        [](const std::vector<int32_t> & parents, const std::vector<int32_t> & rank, const std::vector<float> & logp,
           const std::map<int, double> & verify_ms, const std::map<int, double> & tree_verify_ms, double spec_rate,
           bool recurrent) {
            // a tree [root, nodes...] given by parents (parents before children), ranks and the drafter's
            // log-probabilities; costs: ms per verify width, calibrated (widths of a power-of-two grid)
            if (parents.empty() || rank.size() != parents.size() || logp.size() != parents.size()) {
                throw std::invalid_argument("choose_verify_budget: parents, rank and logp need one entry per node");
            }
            draft_tree t;
            t.reset(0);
            for (size_t i = 1; i < parents.size(); ++i) {
                if (parents[i] < 0 || parents[i] >= (int) i) {
                    throw std::invalid_argument("choose_verify_budget: a parent must be an earlier node");
                }
                t.add(0, parents[i], rank[i], logp[i]);
            }
            const int  max_width = verify_ms.empty() ? 1 : verify_ms.rbegin()->first;
            cost_model costs(max_width);
            for (const auto & kv : verify_ms) {
                costs.calibrate_verify(kv.first, false, kv.second);
            }
            for (const auto & kv : tree_verify_ms) {
                costs.calibrate_verify(kv.first, true, kv.second);
            }
            costs.set_spec_rate(spec_rate);
            acceptance_model acceptance;  // the prior: the drafter's probabilities, binned
            return choose_verify_budget(t, costs, acceptance, recurrent);
        },
        py::arg("parents"), py::arg("rank"), py::arg("logp"), py::arg("verify_ms"),
        py::arg("tree_verify_ms") = std::map<int, double>{}, py::arg("spec_rate") = 0.0, py::arg("recurrent") = false,
        "auto's per-round choice (decode/proposer.h) with the given costs and an untrained acceptance model.");

    m.def("device_memory", []() {
        py::dict out;
        out["cpu_free"] = host_available_memory();
        if (ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU)) {
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(dev, &free, &total);
            out["gpu_name"]  = std::string(ggml_backend_dev_name(dev)) + " (" + ggml_backend_dev_description(dev) + ")";
            out["gpu_free"]  = free;
            out["gpu_total"] = total;
        }
        return out;
    }, "Memory this process may use: the system's available bytes, and the first GPU's free and total bytes "
       "(keys absent without a GPU).");

    m.def("rpc_add_server", [](const std::string & endpoint) {
        // ggml's RPC client aborts the process on an endpoint it cannot reach: try it first
        probe_tcp_endpoint(endpoint);
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(endpoint.c_str());
        if (!reg) {
            throw std::runtime_error(format("could not reach the RPC server at %s", endpoint.c_str()));
        }
        ggml_backend_register(reg);
    }, py::arg("endpoint"),
       "Registers the devices of an RPC server (host:port: ggml's rpc-server, or rpc_serve) for the process: later "
       "models offload to the first as to a GPU. Raises ConnectionError when it cannot be reached (a server that "
       "goes away later aborts the process: ggml's RPC client). For tests (tests/test_rpc.py).");
    m.def("rpc_serve", [](const std::string & endpoint, int64_t n_threads) {
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        py::gil_scoped_release nogil;
        ggml_backend_rpc_start_server(endpoint.c_str(), nullptr, (size_t) n_threads, 1, &cpu);
    }, py::arg("endpoint"), py::arg("n_threads") = 1,
       "Serves this machine's CPU as an RPC device at host:port until the process ends (for tests).");

    py::class_<py_model>(m, "Model")
        .def(py::init([](const std::string & path, int64_t n_gpu_layers, int64_t n_threads, py::object progress,
                         bool plan_only, const std::string & delta_net) {
                 model_params p;
                 p.n_gpu_layers = (int) checked("n_gpu_layers", n_gpu_layers, -1, INT32_MAX);
                 p.n_threads    = (int) checked("n_threads", n_threads, 0, INT32_MAX);
                 p.progress     = progress_callback(progress);
                 p.plan_only    = plan_only;
                 if (delta_net == "auto") {
                     p.delta_net = delta_net_form::automatic;
                 } else if (delta_net == "fused") {
                     p.delta_net = delta_net_form::fused;
                 } else if (delta_net == "chunked") {
                     p.delta_net = delta_net_form::chunked;
                 } else {
                     throw std::invalid_argument(format("delta_net = '%s', expected 'auto', 'fused' or 'chunked'",
                                                        delta_net.c_str()));
                 }
                 std::unique_ptr<target_model> loaded;
                 {
                     py::gil_scoped_release nogil;
                     loaded = load_target_model(path, p);
                 }
                 return py_model{std::shared_ptr<const target_model>(std::move(loaded))};
             }),
             py::arg("path"), py::arg("n_gpu_layers") = 0, py::arg("n_threads") = 0, py::arg("progress") = py::none(),
             py::arg("plan_only") = false, py::arg("delta_net") = "auto",
             "progress: called as progress(bytes read, bytes in all) while the weights load. plan_only: for a memory "
             "plan (pydflash.plan): the GGUF's metadata only, buffers that reserve address space only, layers "
             "placeable on a GPU this machine lacks; sessions over it measure graphs and cannot run them. delta_net "
             "(hybrid targets): how prefill micro-batches run the delta rule: 'fused' (ggml_gated_delta_net), "
             "'chunked' (stock ops, models/delta_net.h) or 'auto' (fused where the backend has the op).")
        .def_property_readonly("plan_only", [](const py_model & m) { return m.model->devices().plan_only(); })
        .def_property_readonly("n_gpu_layers", [](const py_model & m) { return m.model->devices().n_gpu_layers(); },
                               "Layers of [0 .. n_layer] on the GPU (the output head counts as layer n_layer).")
        .def_property_readonly("weight_memory", [](const py_model & m) { return as_pair(m.model->weight_memory()); },
                               "(CPU bytes, GPU bytes) of the weight buffers.")
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

    py::class_<py_draft_model>(m, "DraftModel")
        .def(py::init([](const py_model & target, const std::string & path, py::object progress) {
                 const load_progress on_progress = progress_callback(progress);
                 py::gil_scoped_release nogil;
                 return py_draft_model{std::make_shared<dflash_draft>(path, target.model, on_progress)};
             }),
             py::arg("target"), py::arg("path"), py::arg("progress") = py::none(), py::keep_alive<1, 2>(),
             "DFlash draft weights for `target`, to share between DraftSessions (one per target session).")
        .def_property_readonly("block_size", [](const py_draft_model & d) { return d.model->block_size(); })
        .def_property_readonly("weight_bytes", [](const py_draft_model & d) { return d.model->weight_bytes(); })
        .def_property_readonly("weight_memory",
                               [](const py_draft_model & d) { return as_pair(d.model->weight_memory()); })
        .def_property_readonly("placement", [](const py_draft_model & d) {
            return placement_list(d.model->weight_placement());
        });

    py::class_<py_draft>(m, "DraftSession")
        .def(py::init([](const py::object & target_arg, const py::object & weights, int64_t n_ctx,
                         int64_t block_size, int64_t window, int64_t ring_capacity, int64_t top_k, bool with_logprobs,
                         int64_t max_verify) {
                 // the target: a Model, or a Session whose backends and thread pool the drafter then shares
                 std::shared_ptr<const target_model> target;
                 std::shared_ptr<compute_backends>   compute;
                 if (py::isinstance<session>(target_arg)) {
                     const session & s = target_arg.cast<const session &>();
                     compute           = s.compute();
                     target            = s.shared_model();
                 } else if (py::isinstance<py_model>(target_arg)) {
                     target = target_arg.cast<const py_model &>().model;
                 } else {
                     throw py::type_error(format("target must be a Model or a Session, got %s",
                                                 type_name(target_arg).c_str()));
                 }
                 checked("n_ctx", n_ctx, 1, MAX_CTX);
                 checked("block_size", block_size, 0, dflash_draft::MAX_BLOCK_SIZE);
                 checked("window", window, 1, INT32_MAX);
                 checked("ring_capacity", ring_capacity, 1, INT32_MAX);
                 checked("top_k", top_k, 1, INT32_MAX);
                 checked("max_verify", max_verify, 0, INT32_MAX);
                 std::shared_ptr<const dflash_draft> draft;
                 if (py::isinstance<py_draft_model>(weights)) {
                     draft = weights.cast<const py_draft_model &>().model;
                     if (&draft->target() != target.get()) {
                         throw std::invalid_argument("the DraftModel was loaded for another target Model");
                     }
                 } else if (py::isinstance<py::str>(weights)) {
                     const std::string path = weights.cast<std::string>();
                     py::gil_scoped_release nogil;
                     draft = std::make_shared<dflash_draft>(path, target);
                 } else {
                     throw py::type_error(format("draft must be a path (str) or a DraftModel, got %s",
                                                 type_name(weights).c_str()));
                 }
                 draft_params params;
                 params.block         = (int) block_size;
                 params.window        = (int) window;
                 params.ring_capacity = (int) ring_capacity;
                 params.top_k         = (int) top_k;
                 params.with_logprobs = with_logprobs;
                 py_draft d;
                 d.session = std::make_unique<draft_session>(draft, (uint32_t) n_ctx, params, compute);
                 if (max_verify == 0) {
                     max_verify = std::min(64, d.session->ring().capacity());
                 }
                 if (max_verify < 1 || max_verify > d.session->ring().capacity()) {
                     throw std::invalid_argument(format("max_verify = %lld must be in [1, %d] (the feature ring's rows)",
                                                        (long long) max_verify, d.session->ring().capacity()));
                 }
                 d.state = std::make_unique<speculation_state>((int) max_verify);
                 return d;
             }),
             py::arg("target"), py::arg("draft"), py::arg("n_ctx"), py::arg("block_size") = 0,
             py::arg("window") = draft_params{}.window, py::arg("ring_capacity") = draft_params{}.ring_capacity,
             py::arg("top_k") = draft_params{}.top_k, py::arg("with_logprobs") = true, py::arg("max_verify") = 0,
             py::keep_alive<1, 2>())
        .def_property_readonly("block_size", [](const py_draft & d) { return d.session->block(); })
        .def_property_readonly("trained_block_size", [](const py_draft & d) { return d.session->model().block_size(); })
        .def_property_readonly("mask_token", [](const py_draft & d) { return d.session->model().mask_token(); })
        .def_property_readonly("capture_layers", [](const py_draft & d) { return d.session->model().capture_layers(); })
        .def_property_readonly("weight_bytes", [](const py_draft & d) { return d.session->model().weight_bytes(); })
        .def_property_readonly("kv_bytes", [](const py_draft & d) { return d.session->kv_bytes(); })
        .def_property_readonly("window", [](const py_draft & d) { return d.session->window(); })
        .def("forget", [](py_draft & d) { d.session->truncate(0); },
             "Drop every context row: the target went on without this draft (plain decoding), so the rows no "
             "longer follow its history and a later prompt must not reuse them.")
        .def(
            "acceptance_observed",
            [](const py_draft & d, int64_t depth, int64_t rank) {
                const auto [tried, accepted] = d.state->acceptance.observed(
                    (int) checked("depth", depth, 1, 256), (int) checked("rank", rank, 0, INT32_MAX));
                return py::make_tuple(tried, accepted);
            },
            py::arg("depth"), py::arg("rank"),
            "The (decayed) counts auto learnt from: drafted tokens at `depth` of `rank` tried, and accepted (summed "
            "acceptance probabilities when sampling).")
        .def_property_readonly("top_k", [](const py_draft & d) { return d.session->top_k(); })
        .def_property_readonly("ring_capacity", [](py_draft & d) { return d.session->ring().capacity(); })
        .def_property_readonly("ring_bytes", [](py_draft & d) { return d.session->ring().n_bytes(); })
        .def_property_readonly("kv_memory", [](const py_draft & d) { return as_pair(d.session->kv_memory()); })
        .def_property_readonly("ring_memory", [](const py_draft & d) { return as_pair(d.session->ring_memory()); })
        .def_property_readonly("compute_memory",
                               [](const py_draft & d) { return as_pair(d.session->compute_memory()); },
                               "(CPU bytes, GPU bytes) of the compute buffer its graphs share, as allocated so far.")
        .def("measure_compute", [](py_draft & d, int64_t n_rows, int64_t n_block, int64_t n_kv) {
                 return d.session->measure((int) checked("n_rows", n_rows, 0, INT32_MAX),
                                           (int) checked("n_block", n_block, 0, INT32_MAX),
                                           (int) checked("n_kv", n_kv, 0, INT32_MAX));
             }, py::arg("n_rows"), py::arg("n_block"), py::arg("n_kv"),
             "Compute buffer bytes of the graph appending n_rows context rows (0 or one of append_row_counts) and "
             "drafting n_block positions over n_kv cache slots (ggml's allocator; nothing allocated).")
        .def_property_readonly_static("append_row_counts",
                                      [](py::object) { return draft_session::append_row_counts(); })
        .def_property_readonly_static("window_step", [](py::object) { return draft_session::window_step(); })
        .def_property_readonly("n_slots", [](const py_draft & d) { return d.session->n_slots(); })
        .def(
            "costs",
            [](const py_draft & d) {
                // what the decode loop measured and learnt (auto mode): ms per verify width, draft ms, rates
                const cost_model & c = d.state->costs;
                py::dict           out;
                py::dict           chain, tree;
                for (int w : c.grid()) {
                    chain[py::int_(w)] = c.verify_ms(w, false);
                    tree[py::int_(w)]  = c.verify_ms(w, true);
                }
                // P(accepted | parent accepted) of the drafter's first choice by depth, for drafter probabilities
                // of 0.5-0.6 (the bin at 0.55)
                std::vector<double> p_half;
                for (int depth = 1; depth < d.session->block(); ++depth) {
                    p_half.push_back(d.state->acceptance.p_accept(depth, 0, 0.55));
                }
                out["calibrated"]  = c.calibrated();
                out["verify_ms"]   = chain;
                out["tree_verify_ms"] = tree;
                out["draft_ms"]    = c.draft_ms();
                out["plain_rate"]  = c.plain_rate();
                out["spec_rate"]   = c.spec_rate();
                out["p_accept_at_half"] = p_half;
                py::dict measured, measured_tree;  // (cost_cache.py keeps these across processes)
                for (const cost_model::measurement & x : c.measured()) {
                    (x.tree ? measured_tree : measured)[py::int_(x.width)] = x.ms;
                }
                out["measured"] = py::make_tuple(measured, measured_tree);
                return out;
            },
            "The speculation cost model: measured verify times per width, draft time, rates (tokens/ms), and the "
            "acceptance of the drafter's first choice by depth when it gives it probability 0.5-0.6.")
        .def("restore_costs", [](py_draft & d, const std::map<int, double> & chain, const std::map<int, double> & tree) {
                 std::vector<cost_model::measurement> table;
                 for (const auto & [w, ms] : chain) {
                     table.push_back({w, false, ms});
                 }
                 for (const auto & [w, ms] : tree) {
                     table.push_back({w, true, ms});
                 }
                 d.state->costs.restore(table);
             }, py::arg("verify_ms"), py::arg("tree_verify_ms"),
             "Verify times (ms by grid width) measured earlier, as costs()['measured'] gave them.")
        .def(
            "draft",
            [](py_draft & pd, py::array_t<float, py::array::c_style | py::array::forcecast> feats,
               py::object positions_in, int64_t anchor, int64_t start, bool with_logprobs) -> py::object {
                // feats [m, n_ext*E] of context rows not yet appended (any number: appended in chunks first)
                draft_session &            d         = *pd.session;
                const std::vector<int32_t> positions = int32_array("positions", positions_in);
                const int                  m         = (int) positions.size();
                checked("anchor", anchor, 0, INT32_MAX);  // (the vocabulary bound: draft_session::draft)
                checked("start", start, 0, INT32_MAX);
                if (feats.ndim() != 2 || feats.shape(0) != m) {
                    throw std::invalid_argument("draft: feats must be (len(positions), n_ext * n_embd)");
                }
                if (m > 0 && feats.shape(1) != d.ring().row_width()) {
                    throw std::invalid_argument(format("draft: feats rows have %lld floats, the drafter reads %lld",
                                                       (long long) feats.shape(1), (long long) d.ring().row_width()));
                }
                draft_proposals out;
                {
                    py::gil_scoped_release nogil;
                    // through the ring, in pieces it can hold, like the target's own writes
                    for (int i = 0; i < m; i += d.ring().capacity()) {
                        const int k = std::min(d.ring().capacity(), m - i);
                        d.flush();
                        d.ring().write(feats.data() + (size_t) i * feats.shape(1), positions.data() + i, k);
                        std::vector<int32_t> rows(k);
                        for (int j = 0; j < k; ++j) {
                            rows[j] = d.ring().slot(positions.data()[i + j]);
                        }
                        d.queue(rows.data(), positions.data() + i, k);
                    }
                    out = d.draft((int32_t) anchor, (int) start);
                }
                if (!with_logprobs) {
                    std::vector<int32_t> top1(out.n_positions);
                    for (int i = 0; i < out.n_positions; ++i) {
                        top1[i] = out.id(i, 0);
                    }
                    return py::cast(top1);
                }
                py::array_t<int32_t> ids({out.n_positions, out.top_k});
                py::array_t<float>   lps({out.n_positions, out.top_k});
                std::copy(out.ids.begin(), out.ids.end(), ids.mutable_data());
                std::copy(out.logprobs.begin(), out.logprobs.end(), lps.mutable_data());
                return py::make_tuple(ids, lps);
            },
            py::arg("feats"), py::arg("positions"), py::arg("anchor"), py::arg("start"),
            py::arg("with_logprobs") = false,
            "Append context rows and draft one block [anchor, MASK x (B-1)] at start; returns the B-1 proposals, "
            "or with_logprobs: (ids, logprobs) [B-1, top_k], most likely first.");

    py::class_<session>(m, "Session")
        .def(py::init([](const py_model & m, int64_t n_ctx, const std::string & type_k, const std::string & type_v,
                         int64_t n_ubatch, int64_t n_rollback) {
                 session_params p;
                 p.n_ctx      = (uint32_t) checked("n_ctx", n_ctx, 1, MAX_CTX);
                 p.n_ubatch   = (uint32_t) checked("n_ubatch", n_ubatch, 1, MAX_CTX);
                 p.n_rollback = (uint32_t) checked("n_rollback", n_rollback, 1, MAX_ROLLBACK);
                 p.type_k     = parse_kv_type(type_k);
                 p.type_v     = parse_kv_type(type_v);
                 return std::make_unique<session>(m.model, p);
             }),
             py::arg("model"), py::arg("n_ctx") = 4096, py::arg("type_k") = "f16", py::arg("type_v") = "f16",
             py::arg("n_ubatch") = 512, py::arg("n_rollback") = 16, py::keep_alive<1, 2>())
        .def_property_readonly("n_past", &session::n_past)
        .def_property_readonly("n_ctx", &session::n_ctx)
        .def_property_readonly("n_rollback", &session::n_rollback)
        .def_property_readonly("kv_bytes", &session::kv_bytes)
        .def_property_readonly("recurrent_bytes", &session::recurrent_bytes)
        .def_property("n_ubatch", &session::n_ubatch,
                      [](session & s, int64_t n) { s.set_n_ubatch((uint32_t) checked("n_ubatch", n, 1, MAX_CTX)); },
                      "The prefill micro-batch; setting it forgets the prompt cache's marks.")
        .def(
            "time_prefill",
            [](session & s, py::object tokens_in, std::vector<int> sizes, py_draft * draft, int64_t reps) {
                const std::vector<int32_t> tokens = int32_array("tokens", tokens_in);
                checked("reps", reps, 1, 100);
                py::gil_scoped_release nogil;
                if (draft) {
                    dflash_proposer dp(*draft->session, *draft->state, spec_params{}, s.is_recurrent());
                    return time_prefill_microbatches(s, dp, tokens, sizes, (int) reps);
                }
                plain_proposer pp;
                return time_prefill_microbatches(s, pp, tokens, sizes, (int) reps);
            },
            py::arg("tokens"), py::arg("sizes"), py::arg("draft") = nullptr, py::arg("reps") = 1,
            "Milliseconds per token of a prefill micro-batch of each size (evaluations of the first `size` tokens "
            "into an empty cache, as a prefill with `draft` capturing runs them); the session is left empty.")
        .def(
            "ssm_state",
            [](const session & s, int64_t il) {
                const recurrent_state * rs = s.recurrent();
                if (!rs) {
                    throw std::invalid_argument("ssm_state: the model has no recurrent layers");
                }
                const model_info & info = s.model().info();
                const auto it = std::find_if(info.recurrent_layers.begin(), info.recurrent_layers.end(),
                                             [il](const recurrent_layer_desc & l) { return l.il == il; });
                if (it == info.recurrent_layers.end()) {
                    throw std::out_of_range(format("ssm_state: layer %lld is not a recurrent layer",
                                                   (long long) il));
                }
                ggml_tensor *             t = rs->ssm((int) il);
                py::array_t<float>        out(it->ssm_size);
                ggml_backend_tensor_get(t, out.mutable_data(), (size_t) rs->ssm_row() * t->nb[1],
                                        it->ssm_size * sizeof(float));
                return out;
            },
            py::arg("layer"), "The committed gated-delta-net state of a recurrent layer ([S*S*H_v] floats, the "
                              "fused op's layout).")
        .def_property_readonly("kv_memory", [](const session & s) { return as_pair(s.kv_memory()); })
        .def_property_readonly("recurrent_memory", [](const session & s) { return as_pair(s.recurrent_memory()); })
        .def_property_readonly("compute_memory", [](const session & s) { return as_pair(s.compute_memory()); },
                               "(CPU bytes, GPU bytes) of the compute buffer its graphs share, as allocated so far.")
        .def(
            "measure_eval",
            [](session & s, int64_t n_tokens, int64_t n_kv, std::vector<int> tree_levels, bool whole, bool all_rows,
               bool logits, const py::object & draft) {
                checked("n_tokens", n_tokens, 1, (int64_t) s.n_ctx());
                if (n_kv == 0) {
                    n_kv = s.n_ctx();
                }
                checked("n_kv", n_kv, n_tokens, (int64_t) s.n_ctx());
                int64_t in_levels = 0;
                for (int l : tree_levels) {
                    checked("tree_levels entry", l, 1, n_tokens);
                    in_levels += l;
                }
                if (!tree_levels.empty() && in_levels != n_tokens) {
                    throw std::invalid_argument(format("tree_levels hold %lld nodes, n_tokens = %lld",
                                                       (long long) in_levels, (long long) n_tokens));
                }
                std::vector<int> capture;
                feature_ring *   ring = nullptr;
                if (!draft.is_none()) {
                    py_draft & d = draft.cast<py_draft &>();
                    capture      = d.session->model().capture_layers();
                    ring         = &d.session->ring();
                }
                const readout what{all_rows, logits, 0};
                py::gil_scoped_release nogil;
                return s.measure_eval((int) n_tokens, (int) n_kv, tree_levels, whole, what, capture, ring);
            },
            py::arg("n_tokens"), py::arg("n_kv") = 0, py::arg("tree_levels") = std::vector<int>{},
            py::arg("whole") = false,
            py::arg("all_rows") = true, py::arg("logits") = true, py::arg("draft") = py::none(),
            "Compute buffer bytes of an evaluation of n_tokens over a window of n_kv cache slots (0: the whole "
            "context; a chain, or a tree of tree_levels nodes per depth), capturing into `draft`'s ring as a "
            "speculative eval does: ggml's allocator over its graph, nothing allocated.")
        .def_property_readonly_static("kv_window_step", [](py::object) { return session::KV_WINDOW_STEP; })
        .def_property_readonly("tokens", &session::tokens)
        .def_property_readonly("argmax", &session::argmax, "The greedy pick of each row read by the last eval.")
        .def(
            "eval",
            [](session & s, py::object tokens_in, py::object positions, py::object mask, py::object parents,
               bool all_logits, std::vector<int> capture_layers, int64_t top_k, bool read_logits,
               bool whole) -> py::tuple {
                const std::vector<int32_t> toks = int32_array("tokens", tokens_in);
                const int                  n    = (int) toks.size();
                checked("top_k", top_k, 0, INT32_MAX);
                auto as_rows = [n](py::object o, const char * what) {
                    std::vector<int32_t> a = int32_array(what, o);
                    if ((int) a.size() != n) {
                        throw std::invalid_argument(format("eval: %s must have one entry per token", what));
                    }
                    return a;
                };
                std::vector<int32_t> pos, par;
                std::vector<uint8_t> mk;
                if (!positions.is_none()) {
                    pos = as_rows(positions, "positions");
                }
                if (!parents.is_none()) {
                    par = as_rows(parents, "parents");
                }
                if (!mask.is_none()) {
                    auto a = mask.cast<py::array_t<uint8_t, py::array::c_style | py::array::forcecast>>();
                    if (a.ndim() != 2 || a.shape(0) != n || a.shape(1) != n) {
                        throw std::invalid_argument("eval: mask must have shape (n_tokens, n_tokens)");
                    }
                    mk.assign(a.data(), a.data() + (size_t) n * n);
                }
                batch_layout         layout;
                layout.positions = pos.empty() ? nullptr : pos.data();
                layout.mask      = mk.empty() ? nullptr : mk.data();
                layout.parents   = par.empty() ? nullptr : par.data();
                layout.whole     = whole;
                {
                    py::gil_scoped_release nogil;
                    s.eval(toks.data(), n, layout, readout{all_logits, read_logits, (int) top_k}, capture_layers);
                }
                const int64_t n_vocab = s.model().info().n_vocab, n_embd = s.model().info().n_embd;
                py::array_t<float> logits({(py::ssize_t) (read_logits ? s.n_outputs() : 0), (py::ssize_t) n_vocab});
                std::copy(s.logits().begin(), s.logits().end(), logits.mutable_data());
                py::list captured;
                for (size_t c = 0; c < capture_layers.size(); ++c) {
                    py::array_t<float> h({(py::ssize_t) n, (py::ssize_t) n_embd});
                    std::copy(s.captured(c).begin(), s.captured(c).end(), h.mutable_data());
                    captured.append(h);
                }
                if (top_k > 0) {
                    py::array_t<int32_t> ids({(int64_t) s.n_outputs(), top_k});
                    py::array_t<float>   lps({(int64_t) s.n_outputs(), top_k});
                    std::copy(s.top_ids().begin(), s.top_ids().end(), ids.mutable_data());
                    std::copy(s.top_logprobs().begin(), s.top_logprobs().end(), lps.mutable_data());
                    return py::tuple(py::make_tuple(logits, captured, ids, lps));
                }
                return py::tuple(py::make_tuple(logits, captured));
            },
            py::arg("tokens"), py::arg("positions") = py::none(), py::arg("mask") = py::none(),
            py::arg("parents") = py::none(), py::arg("all_logits") = true,
            py::arg("capture_layers") = std::vector<int>{}, py::arg("top_k") = 0, py::arg("read_logits") = true,
            py::arg("whole") = false,
            "Evaluate tokens into cache slots n_past..; returns (logits [n_out, n_vocab], [hidden [n, n_embd] ...]) "
            "(and top_k ids, log-probabilities [n_out, top_k] when top_k > 0). parents: a tree (parent row per row, "
            "-1: the committed past); mask: any visibility (attention-only models). read_logits=False reads only "
            "the greedy picks (Session.argmax), as the decode loop does; the logits array is then empty. whole=True: "
            "the chain will be committed whole (a prefill), so a hybrid model keeps only its final state.")
        .def("commit", [](session & s, int64_t n) { s.commit((int) checked("n", n, 0, INT32_MAX)); }, py::arg("n"))
        .def("commit", py::overload_cast<const std::vector<int> &>(&session::commit), py::arg("rows"))
        .def("eval_slot", [](const session & s, int64_t row) {
                 if (s.n_pending() == 0) {
                     throw std::invalid_argument("eval_slot: no evaluation is pending");
                 }
                 return s.eval_slot((int) checked("row", row, 0, s.n_pending() - 1));
             }, py::arg("row"))
        .def("truncate", [](session & s, int64_t n_past) { s.truncate((int) checked("n_past", n_past, 0, INT32_MAX)); },
             py::arg("n_past"))
        .def("abort", [](session & s) { s.abort.store(true); })
        .def(
            "read_state",
            [](const session & s) {
                // the committed state as the next evaluation reads it: K and V rows of the committed slots (raw
                // bytes, per attention layer), the SSM state and conv window (per recurrent layer)
                py::dict   d;
                py::list   k, v, ssm, conv;
                const auto & info = s.model().info();
                for (const kv_layer_desc & l : info.kv_layers) {
                    k.append(tensor_rows(s.kv().k(l.il), 0, s.n_past()));
                    v.append(tensor_rows(s.kv().v(l.il), 0, s.n_past()));
                }
                if (const recurrent_state * rs = s.recurrent()) {
                    for (const recurrent_layer_desc & l : info.recurrent_layers) {
                        ssm.append(f32_rows(rs->ssm(l.il), {rs->ssm_row()}).attr("reshape")(-1));
                        conv.append(f32_rows(rs->conv(l.il), rs->conv_rows()));
                    }
                }
                d["k"] = k;
                d["v"] = v;
                d["ssm"] = ssm;
                d["conv"] = conv;
                return d;
            },
            "The committed KV rows and recurrent state (for tests).")
        .def(
            "generate",
            [](session & s, py::object prompt_in, int64_t max_tokens, py::object stop_tokens_in, py::object callback,
               py_draft * draft, const std::string & mode, int64_t tree_budget, const std::string & seed,
               py::object sampling) {
                const std::vector<int32_t> prompt = int32_array("prompt", prompt_in);
                generate_params            p;
                p.max_tokens  = (int) checked("max_tokens", max_tokens, 0, INT32_MAX);
                p.stop_tokens = int32_array("stop_tokens", stop_tokens_in);
                p.sampling    = parse_sampling(sampling);  // (checked by generate before any work)
                spec_params sp;
                sp.mode        = parse_spec_mode(mode);
                sp.tree_budget = (int) checked("tree_budget", tree_budget, 0, 1 << 16);
                sp.seed        = parse_tree_seed(seed);
                token_callback cb;
                if (!callback.is_none()) {
                    cb = [&callback](const int32_t * toks, const token_logprobs * lps, int n) {
                        py::gil_scoped_acquire gil;
                        py::list l;
                        for (int i = 0; i < n; ++i) {
                            l.append(toks[i]);
                        }
                        // a Python exception propagates out of the loop
                        if (lps) {
                            return callback(l, logprobs_dict({lps, lps + n})).cast<bool>();
                        }
                        return callback(l).cast<bool>();
                    };
                }
                generate_result r;
                auto_stats      stats;
                {
                    py::gil_scoped_release nogil;
                    if (draft) {
                        dflash_proposer dp(*draft->session, *draft->state, sp, s.is_recurrent());
                        r     = generate(s, dp, prompt, p, cb);
                        stats = dp.stats();
                    } else {
                        plain_proposer pp;
                        r = generate(s, pp, prompt, p, cb);
                    }
                }
                py::dict d;
                d["tokens"]        = r.tokens;
                d["finish_reason"] = r.finish_reason;
                if (p.sampling.n_logprobs >= 0) {
                    d["logprobs"] = logprobs_dict(r.logprobs);
                }
                d["timings"]       = timings_dict(r.timings, draft != nullptr,
                                                  draft && sp.mode == spec_mode::automatic ? &stats : nullptr);
                return d;
            },
            py::arg("prompt"), py::arg("max_tokens") = 128, py::arg("stop_tokens") = py::list(),
            py::arg("callback") = py::none(), py::arg("draft") = nullptr, py::arg("spec_mode") = "chain",
            py::arg("tree_budget") = 0, py::arg("tree_seed") = "best_first", py::arg("sampling") = py::none(),
            "Generation, greedy or sampled (sampling: a dict of llama-cpp-python's sampling parameters and seed), "
            "speculative with a DraftSession (spec_mode 'chain', 'tree' or 'auto'); callback(list[int]) -> bool is "
            "called (with the GIL) per batch of committed tokens. With sampling['logprobs'] = n the result has "
            "'logprobs': token_logprobs and top_logprobs ([(id, logprob)] * n) per token, and the callback gets the "
            "batch's as a second argument.");

    m.def(
        "sample",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, py::object sampling,
           py::object history_in, int64_t t) {
            if (logits.ndim() != 1 || logits.shape(0) < 1) {
                throw std::invalid_argument("sample: logits must be one non-empty row");
            }
            const int64_t              V       = logits.shape(0);
            const std::vector<int32_t> history = int32_array("history", history_in);
            for (int32_t h : history) {
                checked("history token", h, 0, V - 1);
            }
            token_sampler smp(parse_sampling(sampling), V, (int) std::max<size_t>(1, history.size()));
            smp.set_history(history.data(), (int) history.size());
            const int32_t token = smp.sample(logits.data(), (uint64_t) checked("t", t, 0, INT64_MAX));
            const auto    dist  = smp.distribution();
            py::array_t<int32_t> ids((py::ssize_t) dist.size());
            py::array_t<double>  probs((py::ssize_t) dist.size());
            for (size_t i = 0; i < dist.size(); ++i) {
                ids.mutable_data()[i]   = dist[i].first;
                probs.mutable_data()[i] = dist[i].second;
            }
            py::dict d;
            d["token"] = token;
            d["ids"]   = ids;
            d["probs"] = probs;
            if (smp.params().n_logprobs >= 0) {
                d["logprobs"] = logprobs_dict({smp.logprobs()});
            }
            return d;
        },
        py::arg("logits"), py::arg("sampling"), py::arg("history") = py::list(), py::arg("t") = 0,
        "One draw of the sampler chain over a row of logits, for tests: the token, the candidates it chose among "
        "(ids in id order, probabilities) and, with sampling['logprobs'], the log-probabilities. history: the "
        "tokens the penalties look back over (repeat_last_n -1 takes all of them).");
}
