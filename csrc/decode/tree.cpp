#include "decode/tree.h"
#include "core/error.h"

#include <algorithm>
#include <queue>

namespace pdf {

int draft_tree::max_depth() const {
    return depth.empty() ? 0 : *std::max_element(depth.begin(), depth.end());
}

bool draft_tree::is_chain() const {
    for (int i = 0; i < size(); ++i) {
        if (parents[i] != i - 1) {
            return false;
        }
    }
    return true;
}

void draft_tree::reset(int32_t root) {
    tokens.assign(1, root);
    parents.assign(1, -1);
    depth.assign(1, 0);
    rank.assign(1, 0);
    logp.assign(1, 0.0f);
    logq.assign(1, 0.0f);
}

int draft_tree::add(int32_t token, int parent, int r, float lp) {
    tokens.push_back(token);
    parents.push_back(parent);
    depth.push_back(depth[parent] + 1);
    rank.push_back(r);
    logp.push_back(lp);
    logq.push_back(logq[parent] + lp);
    return size() - 1;
}

int allowed_prefix(const draft_tree & t, token_constraint & constraint) {
    if (t.is_chain()) {
        return 1 + constraint.valid_prefix(t.tokens.data() + 1, t.size() - 1);
    }
    std::vector<int32_t> path;
    for (int b = 1; b < t.size(); ++b) {
        path.clear();
        for (int v = b; v > 0; v = t.parents[v]) {
            path.push_back(t.tokens[v]);
        }
        std::reverse(path.begin(), path.end());
        if (constraint.valid_prefix(path.data(), (int) path.size()) < (int) path.size()) {
            return b;
        }
    }
    return t.size();
}

void draft_tree::truncate(int n) {
    tokens.resize(n);
    parents.resize(n);
    depth.resize(n);
    rank.resize(n);
    logp.resize(n);
    logq.resize(n);
}

namespace {

// a candidate prefix: the node of rank `rank` at depth `depth` (1-based) below `parent`, with the path's score
struct candidate {
    float score;
    int   depth;
    int   rank;
    int   parent;
    bool operator<(const candidate & o) const {  // priority_queue: best first; ties: shallower, lower rank
        if (score != o.score) {
            return score < o.score;
        }
        return depth != o.depth ? depth > o.depth : rank > o.rank;
    }
};

}  // namespace

void build_draft_chain(const draft_proposals & p, int32_t root, int depth, draft_tree & out) {
    out.reset(root);
    depth = std::min(depth, p.n_positions);
    for (int d = 1; d <= depth; ++d) {
        out.add(p.id(d - 1, 0), d - 1, 0, p.logprob(d - 1, 0));
    }
}

void build_draft_tree(const draft_proposals & p, int32_t root, int budget, int max_depth, tree_seed seed,
                      draft_tree & out, const std::vector<float> * scores) {
    max_depth = std::min(max_depth, p.n_positions);
    out.reset(root);
    if (budget <= 0 || max_depth <= 0) {
        return;
    }
    const int K = p.top_k;
    // by node: the path's score, and (DFlash2's selector) the node's rank among its position's candidates, which
    // ranks its children
    std::vector<float> path_score(1, 0.0f);
    std::vector<int>   selector_rank(1, 0);
    // the rank-th child of `parent` at `depth`: its log-probability given the parent, and its own log-score
    auto logprob = [&](int depth, int rank, int parent) {
        return p.conditional() ? p.child_lp(depth - 1, selector_rank[parent], rank) : p.logprob(depth - 1, rank);
    };
    auto score = [&](int depth, int rank, int parent) {
        return scores ? (*scores)[(size_t) (depth - 1) * K + rank] : logprob(depth, rank, parent);
    };
    std::priority_queue<candidate> heap;
    // taking a node makes two new prefixes candidates: its next sibling and its first child
    auto take = [&](const candidate & c) {
        int32_t token = 0;
        if (p.conditional()) {
            selector_rank.push_back(p.child(c.depth - 1, selector_rank[c.parent], c.rank));
            token = p.all_ids[(size_t) (c.depth - 1) * p.all_k + selector_rank.back()];
        } else {
            selector_rank.push_back(c.rank);
            token = p.id(c.depth - 1, c.rank);
        }
        const int node = out.add(token, c.parent, c.rank, logprob(c.depth, c.rank, c.parent));
        path_score.push_back(c.score);
        if (c.rank + 1 < K) {
            heap.push({path_score[c.parent] + score(c.depth, c.rank + 1, c.parent), c.depth, c.rank + 1, c.parent});
        }
        return node;
    };
    if (seed == tree_seed::chain) {
        // the top-1 chain as deep as the budget allows; its siblings stay candidates, its last node's child too
        int parent = 0;
        for (int d = 1; d <= std::min(max_depth, budget); ++d) {
            parent = take({path_score[parent] + score(d, 0, parent), d, 0, parent});
        }
        const int d_last = out.depth[parent];
        if (d_last < max_depth) {
            heap.push({path_score[parent] + score(d_last + 1, 0, parent), d_last + 1, 0, parent});
        }
    } else {
        heap.push({score(1, 0, 0), 1, 0, 0});
    }
    while (out.size() - 1 < budget && !heap.empty()) {
        const candidate c = heap.top();
        heap.pop();
        const int node = take(c);
        if (c.depth < max_depth) {
            heap.push({c.score + score(c.depth + 1, 0, node), c.depth + 1, 0, node});
        }
    }
}

void walk_target(const draft_tree & t, const std::function<int32_t(int)> & pick,
                 const std::function<double(int32_t)> & probability, std::vector<int> & rows, int32_t & bonus,
                 std::vector<float> & accept_prob) {
    rows.assign(1, 0);
    accept_prob.assign(t.size(), -1.0f);
    for (int cur = 0;;) {
        const int32_t next  = pick(cur);
        int           found = -1;
        // children come after their parent
        for (int c = cur + 1; c < t.size(); ++c) {
            if (t.parents[c] == cur) {
                accept_prob[c] = (float) probability(t.tokens[c]);
                if (found < 0 && t.tokens[c] == next) {
                    found = c;
                }
            }
        }
        if (found < 0) {
            bonus = next;
            return;
        }
        rows.push_back(found);
        cur = found;
    }
}

}  // namespace pdf
