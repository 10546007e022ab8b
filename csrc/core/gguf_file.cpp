#include "core/gguf_file.h"
#include "core/error.h"
#include "core/log.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace pdf {

static bool is_integer_type(gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64:
            return true;
        default:
            return false;
    }
}

static int64_t read_integer(gguf_type t, const void * p) {
    switch (t) {
        case GGUF_TYPE_UINT8:  return *(const uint8_t *) p;
        case GGUF_TYPE_INT8:   return *(const int8_t *) p;
        case GGUF_TYPE_UINT16: return *(const uint16_t *) p;
        case GGUF_TYPE_INT16:  return *(const int16_t *) p;
        case GGUF_TYPE_UINT32: return *(const uint32_t *) p;
        case GGUF_TYPE_INT32:  return *(const int32_t *) p;
        case GGUF_TYPE_UINT64: return (int64_t) *(const uint64_t *) p;
        case GGUF_TYPE_INT64:  return *(const int64_t *) p;
        default:               return 0;
    }
}

static size_t integer_type_size(gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8:  case GGUF_TYPE_INT8:  return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: return 4;
        default:                                     return 8;
    }
}

// RFC 3629 UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF)
static bool is_valid_utf8(const char * s, size_t n) {
    const unsigned char * p = (const unsigned char *) s;
    size_t                i = 0;
    while (i < n) {
        const unsigned c = p[i];
        int      len;
        unsigned lo = 0x80, hi = 0xBF;  // the bounds of the second byte
        if (c < 0x80) {
            ++i;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            len = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            lo  = c == 0xE0 ? 0xA0 : 0x80;
            hi  = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            lo  = c == 0xF0 ? 0x90 : 0x80;
            hi  = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return false;
        }
        if (i + len > n || p[i + 1] < lo || p[i + 1] > hi) {
            return false;
        }
        for (int k = 2; k < len; ++k) {
            if ((p[i + k] & 0xC0) != 0x80) {
                return false;
            }
        }
        i += len;
    }
    return true;
}

static std::string shape_str(const int64_t * ne, int n) {
    std::string s = "{";
    for (int i = 0; i < n; ++i) {
        s += std::to_string(ne[i]) + (i + 1 < n ? ", " : "");
    }
    return s + "}";
}

gguf_file::gguf_file(const std::string & path, bool metadata_only) : path_(path), metadata_only_(metadata_only) {
    int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) {
        throw file_error(format("%s: cannot open file: %s", path.c_str(), strerror(errno)));
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        throw file_error(format("%s: not a regular file", path.c_str()));
    }
    size_ = (size_t) st.st_size;
    char magic[4] = {0, 0, 0, 0};
    ssize_t got = size_ >= 4 ? pread(fd, magic, 4, 0) : 0;
    if (got != 4 || memcmp(magic, "GGUF", 4) != 0) {
        close(fd);
        throw file_error(format("%s: not a GGUF file (expected magic 'GGUF' at offset 0, file has %zu bytes%s)",
                                path.c_str(), size_, got == 4 ? " with another magic" : ""));
    }
    uint32_t version = 0;
    if (size_ < 8 || pread(fd, &version, 4, 4) != 4) {
        close(fd);
        throw file_error(format("%s: truncated GGUF header (%zu bytes)", path.c_str(), size_));
    }
    if (version < 2 || version > 3) {
        close(fd);
        throw unsupported_error(format("%s: GGUF version %u is not supported (expected 2 or 3)", path.c_str(), version));
    }
    map_ = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map_ == MAP_FAILED) {
        map_ = nullptr;
        throw file_error(format("%s: mmap failed: %s", path.c_str(), strerror(errno)));
    }

    gguf_init_params   params = {/*no_alloc =*/true, /*ctx =*/&meta_};
    ggml_error_capture ggml_says;
    gguf_ = gguf_init_from_buffer(map_, size_, params);
    if (!gguf_) {
        munmap(map_, size_);
        map_ = nullptr;
        const std::string & why = ggml_says.lines();
        throw file_error(format("%s: malformed or truncated GGUF header/metadata%s%s", path.c_str(),
                                why.empty() ? "" : " (ggml: ", why.empty() ? "" : (why + ")").c_str()));
    }
    // every tensor's bytes must lie inside the file (unless only its metadata is read: a plan)
    if (!metadata_only_) {
        try {
            check_tensor_bounds();
        } catch (...) {
            release();  // (a throwing constructor runs no destructor)
            throw;
        }
    }
}

void gguf_file::check_tensor_bounds() const {
    const size_t data_offset = gguf_get_data_offset(gguf_);
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf_); ++i) {
        const size_t end = data_offset + gguf_get_tensor_offset(gguf_, i) + gguf_get_tensor_size(gguf_, i);
        if (end > size_) {
            throw file_error(format("%s: truncated: tensor '%s' needs bytes up to %zu but the file has %zu",
                                    path_.c_str(), gguf_get_tensor_name(gguf_, i), end, size_));
        }
    }
}

void gguf_file::require_data() {
    check_tensor_bounds();
    metadata_only_ = false;
}

gguf_file::~gguf_file() { release(); }

void gguf_file::release() {
    if (gguf_) {
        gguf_free(gguf_);
        gguf_ = nullptr;
    }
    if (meta_) {
        ggml_free(meta_);
        meta_ = nullptr;
    }
    if (map_) {
        munmap(map_, size_);
        map_ = nullptr;
    }
}

int64_t gguf_file::key_id(const std::string & key) const { return gguf_find_key(gguf_, key.c_str()); }

bool gguf_file::has_key(const std::string & key) const { return key_id(key) >= 0; }

std::string gguf_file::arch() const {
    if (!has_key("general.architecture")) {
        throw format_error(format("%s: missing key 'general.architecture'", path_.c_str()));
    }
    return str("general.architecture");
}

uint32_t gguf_file::u32(const std::string & key) const {
    int64_t id = key_id(key);
    if (id < 0) {
        throw format_error(format("%s: missing required key '%s'", path_.c_str(), key.c_str()));
    }
    gguf_type t = gguf_get_kv_type(gguf_, id);
    if (!is_integer_type(t)) {
        throw format_error(format("%s: key '%s' has type %s, expected an unsigned integer", path_.c_str(),
                                  key.c_str(), gguf_type_name(t)));
    }
    int64_t v = read_integer(t, gguf_get_val_data(gguf_, id));
    if (v < 0 || v > (int64_t) UINT32_MAX) {
        throw format_error(format("%s: key '%s' = %lld is out of range for a uint32", path_.c_str(), key.c_str(),
                                  (long long) v));
    }
    return (uint32_t) v;
}

uint32_t gguf_file::u32_or(const std::string & key, uint32_t def) const { return has_key(key) ? u32(key) : def; }

float gguf_file::f32(const std::string & key) const {
    int64_t id = key_id(key);
    if (id < 0) {
        throw format_error(format("%s: missing required key '%s'", path_.c_str(), key.c_str()));
    }
    gguf_type t = gguf_get_kv_type(gguf_, id);
    if (t == GGUF_TYPE_FLOAT32) {
        return gguf_get_val_f32(gguf_, id);
    }
    if (t == GGUF_TYPE_FLOAT64) {
        return (float) gguf_get_val_f64(gguf_, id);
    }
    throw format_error(format("%s: key '%s' has type %s, expected float32", path_.c_str(), key.c_str(),
                              gguf_type_name(t)));
}

float gguf_file::f32_or(const std::string & key, float def) const { return has_key(key) ? f32(key) : def; }

bool gguf_file::boolean_or(const std::string & key, bool def) const {
    int64_t id = key_id(key);
    if (id < 0) {
        return def;
    }
    gguf_type t = gguf_get_kv_type(gguf_, id);
    if (t != GGUF_TYPE_BOOL) {
        throw format_error(format("%s: key '%s' has type %s, expected bool", path_.c_str(), key.c_str(),
                                  gguf_type_name(t)));
    }
    return gguf_get_val_bool(gguf_, id);
}

std::string gguf_file::str(const std::string & key) const {
    int64_t id = key_id(key);
    if (id < 0) {
        throw format_error(format("%s: missing required key '%s'", path_.c_str(), key.c_str()));
    }
    gguf_type t = gguf_get_kv_type(gguf_, id);
    if (t != GGUF_TYPE_STRING) {
        throw format_error(format("%s: key '%s' has type %s, expected string", path_.c_str(), key.c_str(),
                                  gguf_type_name(t)));
    }
    std::string value = gguf_get_val_str(gguf_, id);
    if (!is_valid_utf8(value.data(), value.size())) {
        throw format_error(format("%s: key '%s' is not valid UTF-8 (%zu bytes)", path_.c_str(), key.c_str(),
                                  value.size()));
    }
    return value;
}

uint32_t gguf_file::u32_in(const std::string & key, uint32_t lo, uint32_t hi) const {
    const uint32_t v = u32(key);
    if (v < lo || v > hi) {
        throw format_error(format("%s: key '%s' = %u, expected a value in [%u, %u]", path_.c_str(), key.c_str(), v,
                                  lo, hi));
    }
    return v;
}

uint32_t gguf_file::u32_in_or(const std::string & key, uint32_t def, uint32_t lo, uint32_t hi) const {
    return has_key(key) ? u32_in(key, lo, hi) : def;
}

float gguf_file::f32_in(const std::string & key, float lo, float hi) const {
    const float v = f32(key);
    if (!std::isfinite(v) || !(v > lo && v < hi)) {
        throw format_error(format("%s: key '%s' = %g, expected a finite value in (%g, %g)", path_.c_str(),
                                  key.c_str(), (double) v, (double) lo, (double) hi));
    }
    return v;
}

float gguf_file::f32_in_or(const std::string & key, float def, float lo, float hi) const {
    return has_key(key) ? f32_in(key, lo, hi) : def;
}

int gguf_file::block_count(const std::string & key, uint32_t n_optional_last) const {
    const uint32_t v       = u32(key);
    const int64_t  present = n_blocks_present();
    if (v > MAX_BLOCKS) {  // (a tiny file can name blk.2000000000: the per-layer tables would take gigabytes)
        throw format_error(format("%s: key '%s' = %u, expected at most %d layers", path_.c_str(), key.c_str(), v,
                                  MAX_BLOCKS));
    }
    if (present == 0 && gguf_get_n_tensors(gguf_) == 0) {
        throw format_error(format("%s: the file holds no tensors (a vocabulary-only GGUF, as --vocab-only writes): "
                                  "not a model", path_.c_str()));
    }
    if (v == 0 || (int64_t) v < present || (int64_t) v - (int64_t) n_optional_last > present) {
        throw format_error(format("%s: key '%s' = %u but the file has tensors for %lld layers (blk.N with N < %lld)%s",
                                  path_.c_str(), key.c_str(), v, (long long) present, (long long) present,
                                  (int64_t) v < present ? ": layers would be left unused" : ""));
    }
    return (int) v;
}

int gguf_file::n_blocks_present() const {
    int n = 0;
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf_); ++i) {
        const char * name = gguf_get_tensor_name(gguf_, i);
        if (strncmp(name, "blk.", 4) != 0) {
            continue;
        }
        char *     end = nullptr;
        const long il  = strtol(name + 4, &end, 10);
        if (end != name + 4 && *end == '.' && il >= 0 && il < (long) INT32_MAX) {
            n = std::max(n, (int) il + 1);
        }
    }
    return n;
}

std::vector<int32_t> gguf_file::i32_array(const std::string & key) const {
    int64_t id = key_id(key);
    if (id < 0) {
        throw format_error(format("%s: missing required key '%s'", path_.c_str(), key.c_str()));
    }
    gguf_type t = gguf_get_kv_type(gguf_, id);
    gguf_type at = t == GGUF_TYPE_ARRAY ? gguf_get_arr_type(gguf_, id) : t;
    if (t != GGUF_TYPE_ARRAY || !is_integer_type(at)) {
        throw format_error(format("%s: key '%s' has type %s%s%s, expected an array of integers", path_.c_str(),
                                  key.c_str(), gguf_type_name(t), t == GGUF_TYPE_ARRAY ? " of " : "",
                                  t == GGUF_TYPE_ARRAY ? gguf_type_name(at) : ""));
    }
    const size_t         n    = gguf_get_arr_n(gguf_, id);
    const char *         data = (const char *) gguf_get_arr_data(gguf_, id);
    const size_t         esz  = integer_type_size(at);
    std::vector<int32_t> out(n);
    for (size_t i = 0; i < n; ++i) {
        out[i] = (int32_t) read_integer(at, data + i * esz);
    }
    return out;
}

std::vector<uint32_t> gguf_file::u32_per_layer_in(const std::string & key, int n_layer, uint32_t lo,
                                                  uint32_t hi) const {
    const int64_t id = key_id(key);
    if (id < 0 || gguf_get_kv_type(gguf_, id) != GGUF_TYPE_ARRAY) {
        return std::vector<uint32_t>(n_layer, u32_in(key, lo, hi));
    }
    const gguf_type at = gguf_get_arr_type(gguf_, id);
    const size_t    n  = gguf_get_arr_n(gguf_, id);
    if (!is_integer_type(at) || n != (size_t) n_layer) {
        throw format_error(format("%s: key '%s' is an array of %zu %s, expected one integer or an array of %d "
                                  "integers (one per layer)", path_.c_str(), key.c_str(), n, gguf_type_name(at),
                                  n_layer));
    }
    const char *          data = (const char *) gguf_get_arr_data(gguf_, id);
    std::vector<uint32_t> out(n);
    for (size_t i = 0; i < n; ++i) {
        const int64_t v = read_integer(at, data + i * integer_type_size(at));
        if (v < (int64_t) lo || v > (int64_t) hi) {
            throw format_error(format("%s: key '%s'[%zu] (layer %zu) = %lld, expected a value in [%u, %u]",
                                      path_.c_str(), key.c_str(), i, i, (long long) v, lo, hi));
        }
        out[i] = (uint32_t) v;
    }
    return out;
}

std::vector<bool> gguf_file::bool_array(const std::string & key) const {
    int64_t id = key_id(key);
    if (id < 0) {
        throw format_error(format("%s: missing required key '%s'", path_.c_str(), key.c_str()));
    }
    gguf_type t = gguf_get_kv_type(gguf_, id);
    if (t != GGUF_TYPE_ARRAY || gguf_get_arr_type(gguf_, id) != GGUF_TYPE_BOOL) {
        throw format_error(format("%s: key '%s' has type %s, expected an array of bool", path_.c_str(),
                                  key.c_str(), gguf_type_name(t)));
    }
    const size_t      n    = gguf_get_arr_n(gguf_, id);
    const int8_t *    data = (const int8_t *) gguf_get_arr_data(gguf_, id);
    std::vector<bool> out(n);
    for (size_t i = 0; i < n; ++i) {
        out[i] = data[i] != 0;
    }
    return out;
}

ggml_tensor * gguf_file::find_tensor(const std::string & name) const {
    return ggml_get_tensor(meta_, name.c_str());
}

void gguf_file::check_shape(ggml_tensor * t, std::initializer_list<int64_t> ne) const {
    const int n_expected = (int) ne.size();
    int64_t   expected[GGML_MAX_DIMS] = {1, 1, 1, 1};
    int       i = 0;
    for (int64_t v : ne) {
        expected[i++] = v;
    }
    bool ok = true;
    for (int d = 0; d < GGML_MAX_DIMS; ++d) {
        ok = ok && t->ne[d] == expected[d];
    }
    if (!ok) {
        throw format_error(format("%s: tensor '%s' has shape %s, expected %s", path_.c_str(), t->name,
                                  shape_str(t->ne, std::max(ggml_n_dims(t), n_expected)).c_str(),
                                  shape_str(expected, n_expected).c_str()));
    }
    if (n_expected == 1 && t->type != GGML_TYPE_F32) {
        throw format_error(format("%s: tensor '%s' has type %s, expected f32 (1-D tensors are stored as f32)",
                                  path_.c_str(), t->name, ggml_type_name(t->type)));
    }
    // weights are floats or quantized floats: an integer type (i32...) or a removed quant cannot be multiplied
    const ggml_type_traits * traits     = ggml_get_type_traits(t->type);
    const bool               float_type = t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 ||
                                          t->type == GGML_TYPE_BF16;
    if (traits->blck_size == 0 || !(float_type || (traits->is_quantized && traits->to_float != nullptr))) {
        throw unsupported_error(format("%s: tensor '%s' has type %s, expected a float or quantized type (f32, f16, "
                                       "bf16, q8_0, q4_K...)", path_.c_str(), t->name, ggml_type_name(t->type)));
    }
}

ggml_tensor * gguf_file::require_tensor(const std::string & name, std::initializer_list<int64_t> ne) const {
    ggml_tensor * t = find_tensor(name);
    if (!t) {
        throw format_error(format("%s: missing required tensor '%s'", path_.c_str(), name.c_str()));
    }
    check_shape(t, ne);
    return t;
}

ggml_tensor * gguf_file::optional_tensor(const std::string & name, std::initializer_list<int64_t> ne) const {
    ggml_tensor * t = find_tensor(name);
    if (t) {
        check_shape(t, ne);
    }
    return t;
}

const void * gguf_file::tensor_data(const ggml_tensor * t) const {
    int64_t id = gguf_find_tensor(gguf_, ggml_get_name(t));
    GGML_ASSERT(id >= 0);
    GGML_ASSERT(!metadata_only_);  // a plan reads no tensor data
    return (const char *) map_ + gguf_get_data_offset(gguf_) + gguf_get_tensor_offset(gguf_, id);
}

size_t gguf_file::n_tensors() const { return (size_t) gguf_get_n_tensors(gguf_); }

}  // namespace pdf
