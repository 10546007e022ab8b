// One sink for the core's and ggml's log lines. The bindings install a callback that forwards to Python's
// `logging.getLogger("pydflash")`; without one, warnings and errors go to stderr.
#pragma once

#include <functional>
#include <string>

namespace pdf {

enum log_level { LOG_LEVEL_DEBUG = 0, LOG_LEVEL_INFO = 1, LOG_LEVEL_WARN = 2, LOG_LEVEL_ERROR = 3 };

using log_callback = std::function<void(log_level, const std::string &)>;

void log_set_callback(log_callback cb);  // also routes ggml's own log through it
void log_msg(log_level level, const char * fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 2, 3)))
#endif
    ;

}  // namespace pdf

#define PDF_LOG_DEBUG(...) ::pdf::log_msg(::pdf::LOG_LEVEL_DEBUG, __VA_ARGS__)
#define PDF_LOG_INFO(...)  ::pdf::log_msg(::pdf::LOG_LEVEL_INFO, __VA_ARGS__)
#define PDF_LOG_WARN(...)  ::pdf::log_msg(::pdf::LOG_LEVEL_WARN, __VA_ARGS__)
#define PDF_LOG_ERROR(...) ::pdf::log_msg(::pdf::LOG_LEVEL_ERROR, __VA_ARGS__)
