#include "core/node_trace.h"

#include <cstring>

namespace pdf {

bool node_trace::observe(ggml_tensor * t, bool ask, void * user) {
    auto &     trace = *static_cast<node_trace *>(user);
    const bool wanted = strncmp(ggml_get_name(t), trace.prefix_.c_str(), trace.prefix_.size()) == 0;
    if (ask) {
        return wanted;
    }
    if (!wanted || ggml_is_quantized(t->type)) {
        return true;  // go on computing
    }
    traced_node & n = trace.nodes_[ggml_get_name(t)];
    n.type          = t->type;
    n.ne            = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
    // row by row: a view (argsort_top_k's first k of each row) is not contiguous
    const size_t row = t->ne[0] * ggml_type_size(t->type);
    n.data.resize(row * ggml_nrows(t));
    uint8_t * out = n.data.data();
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3) {
        for (int64_t i2 = 0; i2 < t->ne[2]; ++i2) {
            for (int64_t i1 = 0; i1 < t->ne[1]; ++i1, out += row) {
                ggml_backend_tensor_get(t, out, i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3], row);
            }
        }
    }
    return true;
}

}  // namespace pdf
