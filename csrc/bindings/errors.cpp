// C++ errors (core/error.h) as the classes of pydflash.errors
#include "bindings/common.h"

namespace pdf::bindings {

void register_errors(py::module_ & m) {
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

}  // namespace pdf::bindings
