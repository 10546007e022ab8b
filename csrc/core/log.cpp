#include "core/log.h"
#include "core/error.h"

#include "ggml.h"

#include <cctype>
#include <cstdarg>
#include <cstdio>
#include <mutex>

namespace pdf {

static std::mutex   g_log_mutex;
static log_callback g_log_callback;
static std::string  g_ggml_line;  // ggml logs a line in pieces; assemble before forwarding
static thread_local ggml_error_capture * t_capture = nullptr;

ggml_error_capture::ggml_error_capture() : outer_(t_capture) { t_capture = this; }

ggml_error_capture::~ggml_error_capture() { t_capture = outer_; }

void ggml_error_capture::add(const std::string & line) {
    // ggml starts each line with its function's name ("gguf_init_from_reader: "): not the user's concern
    size_t name_end = 0;
    while (name_end < line.size() && (isalnum((unsigned char) line[name_end]) || line[name_end] == '_')) {
        ++name_end;
    }
    const bool named = name_end > 0 && line.compare(name_end, 2, ": ") == 0;
    lines_ += (lines_.empty() ? "" : "; ") + line.substr(named ? name_end + 2 : 0);
}

std::string format(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(nullptr, 0, fmt, ap);
    va_end(ap);
    std::string out(n > 0 ? n : 0, '\0');
    if (n > 0) {
        vsnprintf(out.data(), out.size() + 1, fmt, ap2);
    }
    va_end(ap2);
    return out;
}

static void emit(log_level level, const std::string & text) {
    log_callback cb;
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        cb = g_log_callback;
    }
    if (cb) {
        cb(level, text);
    } else if (level >= LOG_LEVEL_WARN) {
        fprintf(stderr, "pydflash: %s\n", text.c_str());
    }
}

static void ggml_log_to_sink(enum ggml_log_level level, const char * text, void * /*user*/) {
    log_level ours = LOG_LEVEL_DEBUG;
    switch (level) {
        case GGML_LOG_LEVEL_ERROR: ours = LOG_LEVEL_ERROR; break;
        case GGML_LOG_LEVEL_WARN:  ours = LOG_LEVEL_WARN;  break;
        case GGML_LOG_LEVEL_INFO:  ours = LOG_LEVEL_INFO;  break;
        default:                   ours = LOG_LEVEL_DEBUG; break;
    }
    std::string line;
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        g_ggml_line += text;
        if (g_ggml_line.empty() || g_ggml_line.back() != '\n') {
            return;
        }
        line.swap(g_ggml_line);
    }
    line.pop_back();
    if (ours == LOG_LEVEL_ERROR && t_capture) {
        t_capture->add(line);
    }
    emit(ours, "ggml: " + line);
}

void log_set_callback(log_callback cb) {
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        g_log_callback = std::move(cb);
    }
    ggml_log_set(ggml_log_to_sink, nullptr);
}

void log_msg(log_level level, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    emit(level, buf);
}

}  // namespace pdf
