// Prompt lookup (n-gram) drafting: the tokens that followed earlier occurrences of the context's last n tokens
// are proposed as what comes next. It costs no model at all and is strong wherever the output repeats its
// context: code edits, retrieval-augmented answers, summaries, lists. The index covers the committed tokens and
// grows with them, so each round's lookup is a hash probe per n-gram length, whatever the context's length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace pdf {

struct ngram_params {
    int n_min          = 1;  // shortest suffix matched (1: the anchor token alone)
    int n_max          = 4;  // longest suffix matched (longer matches are tried first)
    int max_candidates = 4;  // distinct continuations proposed per round
};

struct ngram_candidate {
    std::vector<int32_t> tokens;     // what followed the earlier occurrence
    int                  match_len;  // the n of the suffix matched
};

class ngram_index {
  public:
    explicit ngram_index(const ngram_params & p);

    // cover exactly `tokens`: extended when they continue what is covered, else rebuilt (an O(n) comparison)
    void sync(const std::vector<int32_t> & tokens);
    // cover `tokens`, known to continue what is covered (the committed tokens of one generation): only the new
    // ones are indexed
    void extend(const std::vector<int32_t> & tokens);
    // a proposer's round: sync at the first round of a generation (`checked` false; then set), extend after
    void follow(const std::vector<int32_t> & tokens, bool & checked);
    // Up to max_candidates distinct continuations of (covered tokens + anchor), each up to max_depth tokens: what
    // followed the most recent earlier occurrences of its last n tokens, n from n_max down to n_min. A
    // continuation that runs into the suffix itself repeats with the period the match implies ("a b a b" + "a":
    // "b a b a ...")
    std::vector<ngram_candidate> candidates(int32_t anchor, int max_depth) const;
    // the token the covered ones hold most often (the earliest to reach that count); -1: none covered. A guess
    // for a round with no match: right 2-3% of the time on code, and a 2-row evaluation can cost less than a
    // 1-row one (ggml's CPU kernels on the benchmarks' inflated Q8_0 targets: 20 ms against 12.7 for two)
    int32_t                      most_frequent() const { return most_frequent_; }

  private:
    void add_ends_at(size_t end);  // index the n-grams ending at seq_[end]
    uint64_t key(const int32_t * first, int n) const;

    ngram_params                                                     p_;
    std::vector<int32_t>                                             seq_;
    std::vector<std::unordered_map<uint64_t, std::vector<int32_t>>> ends_;  // per n - n_min: key -> end positions
    std::unordered_map<int32_t, int>                                 counts_;  // token -> occurrences covered
    int32_t                                                          most_frequent_ = -1;
};

}  // namespace pdf
