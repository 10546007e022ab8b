// ggml's RPC backend from Python: serve this machine's CPU or GPU as a device (`pydflash rpc-server`), or offload
// to one served elsewhere (`Model(rpc_servers=...)`; tests/test_rpc.py also runs the device code paths on machines
// without a GPU this way)
#include "bindings/common.h"

#include "ggml-rpc.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#ifndef _WIN32
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace pdf::bindings {

// the endpoints registered in this process, named when one of them goes away
static std::mutex               endpoints_mutex;
static std::vector<std::string> endpoints;

// ggml's RPC client cannot return an error from a compute: on a server that went away it aborts the process (with a
// backtrace). Where that happens, say so in one line naming the servers and exit; other aborts print their message
// as ggml would (without the backtrace) and abort.
static void on_ggml_abort(const char * message) {
    if (strstr(message, "RPC") != nullptr) {
        std::string names;
        {
            const std::lock_guard<std::mutex> lock(endpoints_mutex);
            for (const std::string & e : endpoints) {
                names += (names.empty() ? "" : ", ") + e;
            }
        }
        fprintf(stderr, "pydflash: lost the RPC server at %s (it stopped or the connection broke); exiting\n",
                names.c_str());
        fflush(stderr);
        std::_Exit(EXIT_FAILURE);  // (no atexit handlers: the process is mid-compute)
    }
    fprintf(stderr, "%s\n", message);
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

void register_rpc(py::module_ & m) {
    m.def("rpc_add_server", [](const std::string & endpoint) {
        // ggml's RPC client aborts the process on an endpoint it cannot reach: try it first
        probe_tcp_endpoint(endpoint);
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(endpoint.c_str());
        if (!reg) {
            throw std::runtime_error(format("could not reach the RPC server at %s", endpoint.c_str()));
        }
        ggml_backend_register(reg);
        const std::lock_guard<std::mutex> lock(endpoints_mutex);
        endpoints.push_back(endpoint);
        ggml_set_abort_callback(on_ggml_abort);
    }, py::arg("endpoint"),
       "Registers the devices of an RPC server (host:port: pydflash rpc-server, or llama.cpp's rpc-server) for the "
       "process: later models offload to the first as to a GPU. Raises ConnectionError when it cannot be reached; a "
       "server that goes away later ends the process with one line naming it (ggml's RPC client cannot return).");
    m.def("rpc_serve", [](const std::string & endpoint, int64_t n_threads, const std::string & device) {
        checked("n_threads", n_threads, 1, 4096);
        ggml_backend_dev_t dev = nullptr;
        if (device == "gpu" || device == "auto") {
            dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
            if (!dev && device == "gpu") {
                throw py::value_error("device = 'gpu': this build of pydflash found no GPU device to serve");
            }
        } else if (device != "cpu") {
            throw py::value_error(format("device = '%s', expected 'auto', 'cpu' or 'gpu'", device.c_str()));
        }
        if (!dev) {
            dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        }
        py::gil_scoped_release nogil;
        ggml_backend_rpc_start_server(endpoint.c_str(), nullptr, (size_t) n_threads, 1, &dev);
    }, py::arg("endpoint"), py::arg("n_threads") = 1, py::arg("device") = "auto",
       "Serves one device of this machine (auto: the first GPU, else the CPU) at host:port until the process ends. "
       "Unauthenticated: anyone who can reach the port can run graphs and read or write its memory.");
}

}  // namespace pdf::bindings
