// The tree of drafts one round verifies (DDTree, arXiv:2604.12989): the root is the anchor (the last committed
// token, at position start), every other node a drafted token at position start + depth. Nodes are kept in
// the order they were chosen, so parents come before children and every prefix of the order is a tree.
#pragma once

#include "decode/token_constraint.h"
#include "state/draft_session.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace pdf {

struct draft_tree {
    std::vector<int32_t> tokens;   // [root, nodes...]
    std::vector<int32_t> parents;  // -1 for the root
    std::vector<int32_t> depth;    // 0 for the root
    std::vector<int32_t> rank;     // the token's rank among the drafter's candidates at its position (root: 0)
    std::vector<float>   logp;     // the drafter's log-probability of the token at its position (root: 0)
    std::vector<float>   logq;     // log of the drafter's path probability Q: logp summed along the path

    int  size() const { return (int) tokens.size(); }
    int  max_depth() const;
    bool is_chain() const;  // every node the child of the one before
    void reset(int32_t root);
    int  add(int32_t token, int parent, int rank, float logp);
    void truncate(int n);   // keep the first n nodes (root included)
};

enum class tree_seed {
    best_first,  // DDTree: the `budget` prefixes of highest Q, best first
    chain,       // the drafter's top-1 chain first (as deep as the budget allows), then best first
};

// Up to `budget` nodes below `root` from the drafter's candidates for positions 1..max_depth (p: most likely
// first per position): a best-first search over prefixes by their score, the sum along the path of a per-node
// log-score (sibling of rank r+1 and first child pushed when a node is taken). DDTree's score is the drafter's
// log-probability (scores == nullptr: the path score is log Q); `scores` ([n_positions, top_k], non-increasing
// in rank) replaces it, e.g. by calibrated log acceptance probabilities.
void build_draft_tree(const draft_proposals & p, int32_t root, int budget, int max_depth, tree_seed seed,
                      draft_tree & out, const std::vector<float> * scores = nullptr);

// the nodes `constraint` allows, as a prefix of the tree's order (parents come before their children): up to the
// first node whose path below the root it forbids
int allowed_prefix(const draft_tree & t, token_constraint & constraint);

// the top-1 chain of `depth` drafts (the chain DFlash verifies)
void build_draft_chain(const draft_proposals & p, int32_t root, int depth, draft_tree & out);

// The target-only acceptance walk: from the root, the target chooses the token after the current node
// (pick(node): its greedy pick, or a draw from its sampling distribution at that node) and the walk moves to the
// child carrying it; when no child does, that token is the bonus (the next root). Every committed token is the
// target's own choice, whatever was drafted. rows: the accepted nodes, root first. accept_prob[c], for each child c
// of a visited node: the probability that the target chose c's token there (probability(token), asked right
// after pick(parent)); -1 for nodes whose parent was not visited.
void walk_target(const draft_tree & t, const std::function<int32_t(int)> & pick,
                 const std::function<double(int32_t)> & probability, std::vector<int> & rows, int32_t & bonus,
                 std::vector<float> & accept_prob);

}  // namespace pdf
