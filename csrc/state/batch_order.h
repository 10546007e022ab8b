// Where the rows of one evaluation's batch go: row i to cache slot n_past + slot_of[i]. A chain, and a tree on an
// attention-only model, keep the rows as given; a tree on a recurrent model puts them in level order (the nodes
// of one depth side by side), which its graph runs depth by depth (core/model_desc.h, recurrent_inputs).
#pragma once

#include <cstdint>
#include <vector>

namespace pdf {

struct batch_order {
    std::vector<int>     depth;        // by row: the distance from the committed past (0 without parents)
    std::vector<int>     row_of;       // slot -> row
    std::vector<int32_t> slot_of;      // row -> slot (empty: the identity)
    std::vector<int32_t> parent_slot;  // slot -> the parent's slot (-1: the committed past); a chain: slot - 1
    std::vector<int>     levels;       // a level-ordered tree: its nodes per depth; else empty
    bool                 tree() const { return !levels.empty(); }
};

// n rows with `parents` (nullptr: a chain; else each row's parent row, -1 for the committed past, parents
// first); by_level: a batch that is not a chain goes in level order. Throws std::invalid_argument naming a
// parent that is not an earlier row.
batch_order order_batch(int n, const int32_t * parents, bool by_level);

}  // namespace pdf
