#include "decode/ngram_index.h"
#include "core/error.h"

#include <algorithm>

namespace pdf {

// earlier occurrences looked at per n-gram length and round, most recent first (a token repeated thousands of
// times must not make a round's lookup scan them all)
static constexpr int MAX_OCCURRENCES = 64;

ngram_index::ngram_index(const ngram_params & p) : p_(p) {
    if (p.n_min < 1 || p.n_max < p.n_min || p.n_max > 16 || p.max_candidates < 1) {
        throw std::invalid_argument(format("n-gram lookup: n_min = %d, n_max = %d, max_candidates = %d; expected "
                                           "1 <= n_min <= n_max <= 16 and max_candidates >= 1",
                                           p.n_min, p.n_max, p.max_candidates));
    }
    ends_.resize(p.n_max - p.n_min + 1);
}

uint64_t ngram_index::key(const int32_t * first, int n) const {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t) n;
    for (int i = 0; i < n; ++i) {
        h ^= (uint64_t) (uint32_t) first[i] + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
    }
    return h;
}

void ngram_index::add_ends_at(size_t end) {
    for (int n = p_.n_min; n <= p_.n_max && (size_t) n <= end + 1; ++n) {
        ends_[n - p_.n_min][key(seq_.data() + end + 1 - n, n)].push_back((int32_t) end);
    }
}

void ngram_index::sync(const std::vector<int32_t> & tokens) {
    const bool continues = tokens.size() >= seq_.size() && std::equal(seq_.begin(), seq_.end(), tokens.begin());
    if (!continues) {
        seq_.clear();
        for (auto & m : ends_) {
            m.clear();
        }
        counts_.clear();
        most_frequent_ = -1;
    }
    extend(tokens);
}

void ngram_index::extend(const std::vector<int32_t> & tokens) {
    for (size_t i = seq_.size(); i < tokens.size(); ++i) {
        seq_.push_back(tokens[i]);
        add_ends_at(i);
        const int n = ++counts_[tokens[i]];
        if (most_frequent_ < 0 || n > counts_[most_frequent_]) {
            most_frequent_ = tokens[i];
        }
    }
}

void ngram_index::follow(const std::vector<int32_t> & tokens, bool & checked) {
    if (checked) {
        extend(tokens);
    } else {
        sync(tokens);
        checked = true;
    }
}

std::vector<ngram_candidate> ngram_index::candidates(int32_t anchor, int max_depth) const {
    std::vector<ngram_candidate> out;
    if (max_depth <= 0) {
        return out;
    }
    const size_t L = seq_.size() + 1;  // the covered tokens and the anchor
    auto at = [&](size_t i) { return i < seq_.size() ? seq_[i] : anchor; };
    std::vector<int32_t> suffix;
    for (int n = std::min<int>(p_.n_max, (int) L - 1); n >= p_.n_min && (int) out.size() < p_.max_candidates; --n) {
        suffix.clear();
        for (size_t i = L - n; i < L; ++i) {
            suffix.push_back(at(i));
        }
        const auto hit = ends_[n - p_.n_min].find(key(suffix.data(), n));
        if (hit == ends_[n - p_.n_min].end()) {
            continue;
        }
        const std::vector<int32_t> & ends = hit->second;
        int looked = 0;
        for (auto e = ends.rbegin(); e != ends.rend() && looked < MAX_OCCURRENCES &&
                                     (int) out.size() < p_.max_candidates; ++e, ++looked) {
            if (!std::equal(suffix.begin(), suffix.end(), seq_.begin() + (*e + 1 - n))) {
                continue;  // a hash collision
            }
            // what followed, then (a match overlapping the suffix: a repetition of period L - 1 - e) the same again
            ngram_candidate c{{}, n};
            const size_t    period = L - 1 - (size_t) *e;
            for (int k = 0; k < max_depth; ++k) {
                c.tokens.push_back(at((size_t) *e + 1 + (size_t) k % period));
            }
            // (a continuation that is the start of one already found adds nothing)
            const bool seen = std::any_of(out.begin(), out.end(), [&](const ngram_candidate & o) {
                return o.tokens.size() >= c.tokens.size() &&
                       std::equal(c.tokens.begin(), c.tokens.end(), o.tokens.begin());
            });
            if (!seen) {
                out.push_back(std::move(c));
            }
        }
    }
    return out;
}

}  // namespace pdf
