// ggml's RPC backend from Python: serve this machine's CPU as a device, or offload to one served elsewhere
// (tests/test_rpc.py runs the device code paths on machines without a GPU this way)
#include "bindings/common.h"

#include "ggml-rpc.h"

#ifndef _WIN32
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace pdf::bindings {

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
}

}  // namespace pdf::bindings
