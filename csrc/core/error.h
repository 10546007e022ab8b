// Typed errors of the pydflash core. Every user-reachable failure throws one of these (never aborts);
// the message names the file, key or tensor and gives expected vs actual. GGML_ASSERT is kept for our own
// invariants. The bindings map each class to the Python class of the same role in pydflash/errors.py.
#pragma once

#include <stdexcept>
#include <string>

namespace pdf {

struct error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// the file cannot be opened or read, or is not GGUF / is truncated
struct file_error : error {
    using error::error;
};

// a key or tensor is missing, mistyped or misshapen
struct format_error : file_error {
    using file_error::file_error;
};

// valid file, but something we do not run (architecture, tensor type, feature)
struct unsupported_error : file_error {
    using file_error::file_error;
};

// the prompt or the requested context does not fit
struct context_overflow_error : error {
    context_overflow_error(const std::string & msg, long long n_tokens, long long n_ctx)
        : error(msg), n_tokens(n_tokens), n_ctx(n_ctx) {}
    long long n_tokens;
    long long n_ctx;
};

// a backend failed to allocate or compute
struct backend_error : error {
    using error::error;
};

std::string format(const char * fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 1, 2)))
#endif
    ;

}  // namespace pdf
