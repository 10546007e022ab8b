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

// Keeps the ggml error lines logged on this thread while it lives (they still reach the sink): ggml's parsers
// say what they found wrong only in their log, and an exception should carry it.
class ggml_error_capture {
  public:
    ggml_error_capture();
    ~ggml_error_capture();
    ggml_error_capture(const ggml_error_capture &)             = delete;
    ggml_error_capture & operator=(const ggml_error_capture &) = delete;

    void               add(const std::string & line);
    const std::string & lines() const { return lines_; }  // joined with "; "

  private:
    std::string          lines_;
    ggml_error_capture * outer_;
};

}  // namespace pdf

#define PDF_LOG_DEBUG(...) ::pdf::log_msg(::pdf::LOG_LEVEL_DEBUG, __VA_ARGS__)
#define PDF_LOG_INFO(...)  ::pdf::log_msg(::pdf::LOG_LEVEL_INFO, __VA_ARGS__)
#define PDF_LOG_WARN(...)  ::pdf::log_msg(::pdf::LOG_LEVEL_WARN, __VA_ARGS__)
#define PDF_LOG_ERROR(...) ::pdf::log_msg(::pdf::LOG_LEVEL_ERROR, __VA_ARGS__)
