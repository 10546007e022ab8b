// C++ errors (core/error.h) as the classes of pydflash.errors
#include "bindings/common.h"

#include <cstring>

namespace pdf::bindings {

// A message may quote a file's bytes (a key's or tensor's name in ggml's words): invalid UTF-8 among them is
// shown as \xHH escapes rather than failing the error's own decoding (a UnicodeDecodeError instead of ours)
static void set_error(const py::object & type, const char * what) {
    PyObject * text = PyUnicode_DecodeUTF8(what, (Py_ssize_t) strlen(what), "backslashreplace");
    if (!text) {
        return;  // (the decoder's own error is set)
    }
    PyErr_SetObject(type.ptr(), text);
    Py_DECREF(text);
}

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
            set_error(py_format_error, e.what());
        } catch (const unsupported_error & e) {
            set_error(py_unsupported_error, e.what());
        } catch (const file_error & e) {
            set_error(py_file_error, e.what());
        } catch (const context_overflow_error & e) {
            py::object exc = py_ctx_error(e.what(), e.n_tokens, e.n_ctx);
            PyErr_SetObject(py_ctx_error.ptr(), exc.ptr());
        } catch (const backend_error & e) {
            set_error(py_backend_error, e.what());
        } catch (const pdf::error & e) {
            set_error(py_error, e.what());
        }
    });
    (void) m;
}

}  // namespace pdf::bindings
