// ggml's quantizer, for the converters (pydflash/convert)
#include "bindings/common.h"
#include "core/quantize.h"

namespace pdf::bindings {

static py::array_t<uint8_t> quantize(py::array_t<float, py::array::c_style | py::array::forcecast> data,
                                     int64_t type) {
    checked("type", type, 0, GGML_TYPE_COUNT - 1);
    if (data.ndim() != 2) {
        throw std::invalid_argument("quantize: data must be 2-D (n_rows, n_per_row)");
    }
    const int64_t n_rows = data.shape(0), n_per_row = data.shape(1);
    const size_t  row    = quantized_row_size((ggml_type) type, n_per_row);
    py::array_t<uint8_t> out({(py::ssize_t) n_rows, (py::ssize_t) row});
    const float * src = data.data();
    uint8_t *     dst = out.mutable_data();
    {
        py::gil_scoped_release nogil;
        quantize_rows((ggml_type) type, src, dst, n_rows, n_per_row);
    }
    return out;
}

void register_quantize(py::module_ & m) {
    m.def("ggml_type_id", &parse_kv_type, py::arg("name"));
    m.def("quantized_row_size", [](int64_t type, int64_t n_per_row) {
        return quantized_row_size((ggml_type) checked("type", type, 0, GGML_TYPE_COUNT - 1), n_per_row);
    });
    m.def("quantize", &quantize, py::arg("data"), py::arg("type"),
          "Quantize float32 rows with ggml's quantizer; returns uint8 (n_rows, row_bytes).");
}

}  // namespace pdf::bindings
