// GGUF metadata read with ggml's parser, for the tokenizer and the converters
#include "bindings/common.h"
#include "core/gguf_file.h"

#include <cstring>

namespace pdf::bindings {

// element i of an array key, or the scalar value of a key (GGUF stores both as plain little-endian data)
template <typename T> static T gguf_number(const gguf_context * g, int64_t id, size_t i, bool array) {
    const void * data = array ? gguf_get_arr_data(g, id) : gguf_get_val_data(g, id);
    return ((const T *) data)[array ? i : 0];
}

// value of one GGUF key (or array element) as a Python object
static py::object gguf_value(const gguf_context * g, int64_t id, gguf_type t, size_t i, bool array) {
    switch (t) {
        case GGUF_TYPE_UINT8:   return py::int_(gguf_number<uint8_t>(g, id, i, array));
        case GGUF_TYPE_INT8:    return py::int_(gguf_number<int8_t>(g, id, i, array));
        case GGUF_TYPE_UINT16:  return py::int_(gguf_number<uint16_t>(g, id, i, array));
        case GGUF_TYPE_INT16:   return py::int_(gguf_number<int16_t>(g, id, i, array));
        case GGUF_TYPE_UINT32:  return py::int_(gguf_number<uint32_t>(g, id, i, array));
        case GGUF_TYPE_INT32:   return py::int_(gguf_number<int32_t>(g, id, i, array));
        case GGUF_TYPE_UINT64:  return py::int_(gguf_number<uint64_t>(g, id, i, array));
        case GGUF_TYPE_INT64:   return py::int_(gguf_number<int64_t>(g, id, i, array));
        case GGUF_TYPE_FLOAT32: return py::float_(gguf_number<float>(g, id, i, array));
        case GGUF_TYPE_FLOAT64: return py::float_(gguf_number<double>(g, id, i, array));
        case GGUF_TYPE_BOOL:    return py::bool_(gguf_number<int8_t>(g, id, i, array) != 0);
        case GGUF_TYPE_STRING: {
            const char * s = array ? gguf_get_arr_str(g, id, i) : gguf_get_val_str(g, id);
            // surrogateescape: a vocabulary entry that is not valid UTF-8 still round-trips to its bytes
            PyObject * o = PyUnicode_DecodeUTF8(s, (Py_ssize_t) strlen(s), "surrogateescape");
            if (!o) {
                throw py::error_already_set();
            }
            return py::reinterpret_steal<py::object>(o);
        }
        default:                return py::none();
    }
}

// {key: (gguf type, element type or None, value)} for the keys present
static py::dict gguf_metadata(const std::string & path, const std::vector<std::string> & keys) {
    std::unique_ptr<gguf_file> file;
    {
        py::gil_scoped_release nogil;
        file = std::make_unique<gguf_file>(path);
    }
    const gguf_context * g = file->metadata();
    py::dict out;
    for (const std::string & key : keys) {
        const int64_t id = gguf_find_key(g, key.c_str());
        if (id < 0) {
            continue;
        }
        const gguf_type t = gguf_get_kv_type(g, id);
        if (t != GGUF_TYPE_ARRAY) {
            out[py::str(key)] = py::make_tuple((int) t, py::none(), gguf_value(g, id, t, 0, false));
            continue;
        }
        const gguf_type at = gguf_get_arr_type(g, id);
        const size_t    n  = gguf_get_arr_n(g, id);
        py::list        values(n);
        for (size_t i = 0; i < n; ++i) {
            values[i] = gguf_value(g, id, at, i, true);
        }
        out[py::str(key)] = py::make_tuple((int) t, (int) at, values);
    }
    return out;
}

void register_gguf(py::module_ & m) {
    m.def("gguf_metadata", &gguf_metadata, py::arg("path"), py::arg("keys"),
          "Read metadata keys of a GGUF file with ggml's gguf parser.");
}

}  // namespace pdf::bindings
