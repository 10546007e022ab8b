#include "state/batch_order.h"
#include "core/error.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace pdf {

batch_order order_batch(int n, const int32_t * parents, bool by_level) {
    batch_order o;
    o.depth.assign(n, 0);
    bool chain = true;  // a batch with parents may be a chain after all
    if (parents) {
        for (int i = 0; i < n; ++i) {
            const int p = parents[i];
            if (p < -1 || p >= i) {
                throw std::invalid_argument(format("eval: parents[%d] = %d; a parent must be an earlier row or -1",
                                                   i, p));
            }
            o.depth[i] = p < 0 ? 0 : o.depth[p] + 1;
            chain      = chain && p == i - 1;
        }
    }
    o.row_of.resize(n);
    std::iota(o.row_of.begin(), o.row_of.end(), 0);
    if (by_level && !chain) {
        std::stable_sort(o.row_of.begin(), o.row_of.end(), [&](int a, int b) { return o.depth[a] < o.depth[b]; });
        o.slot_of.assign(n, 0);
        for (int s = 0; s < n; ++s) {
            o.slot_of[o.row_of[s]] = s;
        }
        o.levels.assign(o.depth[o.row_of[n - 1]] + 1, 0);
        for (int i = 0; i < n; ++i) {
            o.levels[o.depth[i]]++;
        }
    }
    o.parent_slot.assign(n, -1);
    for (int s = 0; s < n; ++s) {
        const int p      = parents ? parents[o.row_of[s]] : s - 1;
        o.parent_slot[s] = p < 0 ? -1 : (o.slot_of.empty() ? p : o.slot_of[p]);
    }
    return o;
}

}  // namespace pdf
