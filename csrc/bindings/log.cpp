// The core's log (and ggml's) to a Python callable: pydflash forwards it to the "pydflash" logger
#include "bindings/common.h"
#include "core/log.h"

namespace pdf::bindings {

static void set_log_callback(py::object cb) {
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
}

void register_log(py::module_ & m) {
    log_set_callback(nullptr);  // ggml's log goes through our sink (warnings to stderr) until Python sets one
    m.def("set_log_callback", &set_log_callback, py::arg("callback"),
          "callback(level, text) for the core's log lines (None: warnings to stderr).");
}

}  // namespace pdf::bindings
