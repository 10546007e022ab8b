#include "core/gguf_file.h"
#include "core/error.h"

#include <cstdio>
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

static std::string shape_str(const int64_t * ne, int n) {
    std::string s = "{";
    for (int i = 0; i < n; ++i) {
        s += std::to_string(ne[i]) + (i + 1 < n ? ", " : "");
    }
    return s + "}";
}

gguf_file::gguf_file(const std::string & path) : path_(path) {
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

    gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/&meta_};
    gguf_ = gguf_init_from_buffer(map_, size_, params);
    if (!gguf_) {
        munmap(map_, size_);
        map_ = nullptr;
        throw file_error(format("%s: malformed or truncated GGUF header/metadata", path.c_str()));
    }
    // every tensor's bytes must lie inside the file
    const size_t data_offset = gguf_get_data_offset(gguf_);
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf_); ++i) {
        const size_t end = data_offset + gguf_get_tensor_offset(gguf_, i) + gguf_get_tensor_size(gguf_, i);
        if (end > size_) {
            std::string name = gguf_get_tensor_name(gguf_, i);
            release();
            throw file_error(format("%s: truncated: tensor '%s' needs bytes up to %zu but the file has %zu",
                                    path.c_str(), name.c_str(), end, size_));
        }
    }
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
    return gguf_get_val_str(gguf_, id);
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
    if (ggml_get_type_traits(t->type)->blck_size == 0 || (ggml_get_type_traits(t->type)->is_quantized &&
                                                             ggml_get_type_traits(t->type)->to_float == nullptr)) {
        throw unsupported_error(format("%s: tensor '%s' has type %s, which this ggml cannot compute with",
                                       path_.c_str(), t->name, ggml_type_name(t->type)));
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
    return (const char *) map_ + gguf_get_data_offset(gguf_) + gguf_get_tensor_offset(gguf_, id);
}

size_t gguf_file::n_tensors() const { return (size_t) gguf_get_n_tensors(gguf_); }

}  // namespace pdf
