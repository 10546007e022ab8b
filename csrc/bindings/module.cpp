// pydflash._core: the one pybind11 module. Coarse calls only; the decode loop runs in C++ with the GIL
// released. C++ errors become the classes of pydflash.errors. Each concept registers itself from a file of
// its own (bindings/common.h lists them); what exists only for the tests is in bindings/test_hooks.cpp.
#include "bindings/common.h"

using namespace pdf::bindings;

PYBIND11_MODULE(_core, m, py::mod_gil_not_used()) {
    m.doc() = "pydflash core (C++/ggml); use the pydflash package, not this module";
    register_errors(m);
    register_log(m);
    register_gguf(m);
    register_quantize(m);
    register_rpc(m);
    register_model(m);
    register_engine_params(m);
    register_draft_session(m);
    register_ngram(m);
    register_mtp(m);
    register_session(m);
    register_session_batch(m);
    register_generate(m);
    register_test_hooks(m);
}
