#include "decode/sampler.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace pdf {

// the draw's first level groups token ids in blocks of 2^DRAW_BLOCK_BITS; block noise is keyed apart from tokens
static constexpr int      DRAW_BLOCK_BITS = 8;
static constexpr uint64_t DRAW_BLOCK_KEY  = 1ull << 40;

// top-p's bins below the largest logit (the last one taking all below them)
static constexpr int   TOP_P_BINS          = 4096;
static constexpr float TOP_P_MAX_BIN_WIDTH = 1.0f / 16;

static constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

bool sampling_params::penalties_on() const {
    return repeat_last_n != 0 && (repeat_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f);
}

bool sampling_params::needs_logits() const {
    return temperature > 0.0f || penalties_on() || !logit_bias.empty() || n_logprobs >= 0 || typical_p < 1.0f ||
           constraint != nullptr;
}

static void check_range(const char * name, double v, double lo, double hi) {
    if (!(v >= lo && v <= hi)) {  // NaN fails too
        throw std::invalid_argument(format("%s = %g, expected a value in [%g, %g]", name, v, lo, hi));
    }
}

void sampling_params::validate(int64_t n_vocab) const {
    const double big = std::numeric_limits<float>::max();
    check_range("temperature", temperature, 0.0, big);
    if (top_k < 0) {
        throw std::invalid_argument(format("top_k = %d, expected 0 (off) or a positive count", top_k));
    }
    check_range("top_p", top_p, 0.0, 1.0);
    check_range("min_p", min_p, 0.0, 1.0);
    check_range("typical_p", typical_p, 0.0, 1.0);
    if (!(repeat_penalty > 0.0f && repeat_penalty <= big)) {
        throw std::invalid_argument(format("repeat_penalty = %g, expected a finite value > 0 (1: off)",
                                           repeat_penalty));
    }
    check_range("presence_penalty", presence_penalty, -big, big);
    check_range("frequency_penalty", frequency_penalty, -big, big);
    if (repeat_last_n < -1) {
        throw std::invalid_argument(format("repeat_last_n = %d, expected -1 (the whole context), 0 (off) or more",
                                           repeat_last_n));
    }
    for (const auto & [id, bias] : logit_bias) {
        if (id < 0 || id >= n_vocab) {
            throw std::invalid_argument(format("logit_bias: token id %d is outside the vocabulary [0, %lld)", id,
                                               (long long) n_vocab));
        }
        if (std::isnan(bias) || bias == std::numeric_limits<float>::infinity()) {
            throw std::invalid_argument(format("logit_bias[%d] = %g, expected a finite value or -inf", id, bias));
        }
    }
    if (n_logprobs < -1 || n_logprobs > n_vocab) {
        throw std::invalid_argument(format("logprobs = %d, expected a count in [0, %lld] (or none)", n_logprobs,
                                           (long long) n_vocab));
    }
}

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

uint64_t draw_key(uint64_t seed, uint64_t t) {
    return splitmix64(splitmix64(seed) ^ t);
}

double draw_gumbel(uint64_t key, uint64_t index) {
    const double u = ((double) (splitmix64(key ^ index) >> 11) + 0.5) * 0x1.0p-53;  // in (0, 1)
    return -std::log(-std::log(u));
}

token_sampler::token_sampler(const sampling_params & params, int64_t n_vocab, int n_ctx)
    : p_(params), n_vocab_(n_vocab) {
    p_.validate(n_vocab);
    window_ = !p_.penalties_on() ? 0 : p_.repeat_last_n < 0 ? n_ctx : p_.repeat_last_n;
    if (window_ > 0) {
        counts_.assign((size_t) n_vocab, 0);
    }
}

void token_sampler::set_history(const int32_t * tokens, int n) {
    history_.clear();
    std::fill(counts_.begin(), counts_.end(), 0);
    for (int i = std::max(0, n - window_); i < n; ++i) {
        accept(tokens[i]);
    }
}

void token_sampler::accept(int32_t token) {
    if (window_ == 0) {
        return;
    }
    if ((int) history_.size() == window_) {
        counts_[history_.front()]--;
        history_.pop_front();
    }
    history_.push_back(token);
    counts_[token]++;
}

void token_sampler::apply_bias_and_penalties() {
    // (results stay below +inf, so that differences to the maximum stay numbers)
    const float top = std::numeric_limits<float>::max();
    for (const auto & [id, bias] : p_.logit_bias) {
        work_[id] = std::min(work_[id] + bias, top);
    }
    if (window_ == 0) {
        return;
    }
    // each distinct token of the window once (llama.cpp's token_count map)
    for (int32_t id : history_) {
        const int c = counts_[id];
        if (c <= 0) {
            continue;
        }
        float & l = work_[id];
        l         = l <= 0.0f ? l * p_.repeat_penalty : l / p_.repeat_penalty;
        // (the subtrahend bounded: -inf minus an overflowed -inf would be NaN)
        const float penalty = (float) std::clamp((double) c * p_.frequency_penalty + p_.presence_penalty,
                                                 -(double) top, (double) top);
        l = std::min(l - penalty, top);
        counts_[id] = -c;  // visited; restored below
    }
    for (int32_t id : history_) {
        counts_[id] = std::abs(counts_[id]);
    }
}

// candidate order: higher logit first, ties to the lower id
static bool better(float la, int32_t ia, float lb, int32_t ib) {
    return la > lb || (la == lb && ia < ib);
}

// e^x for x <= 0, 0 below -87 (e^-87 ~ 1.6e-38) and for -inf: Cody-Waite reduction to r in [-ln2/2, ln2/2]
// and a degree-6 Taylor polynomial (relative error < 2e-7, as std::exp in float), written so that the loops
// over a vocabulary vectorise (`omp simd`; std::exp is a library call per element, a third of a sampled
// step's time over 150K tokens)
static inline float exp_nonpositive(float x) {
    const float keep = x >= -87.0f ? 1.0f : 0.0f;
    x                = x >= -87.0f ? x : -87.0f;
    const float n    = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln 2): the 1.5 * 2^23 trick
    const float r    = (x - n * 0.693359375f) + n * 2.12194440e-4f;    // x - n ln 2, in two parts
    float       q    = 1.0f / 720;
    q                = q * r + 1.0f / 120;
    q                = q * r + 1.0f / 24;
    q                = q * r + 1.0f / 6;
    q                = q * r + 0.5f;
    q                = q * r + 1.0f;
    q                = q * r + 1.0f;
    const int32_t bits = ((int32_t) n + 127) << 23;  // 2^n, n in [-126, 0]
    float         two_n;
    std::memcpy(&two_n, &bits, sizeof(two_n));
    return q * two_n * keep;
}

// out[i] = e^((x[i] - shift) * scale), x[i] <= shift
static void exp_shifted(const float * x, float shift, float scale, float * out, size_t n) {
#pragma omp simd
    for (size_t i = 0; i < n; ++i) {
        out[i] = exp_nonpositive((x[i] - shift) * scale);
    }
}

void token_sampler::materialize_all() {
    cand_.resize((size_t) n_vocab_);
    for (int64_t i = 0; i < n_vocab_; ++i) {
        cand_[i] = {work_[i], (int32_t) i};
    }
    dense_ = false;
}

void token_sampler::select_top_k(int k) {
    k = std::min<int>(k, (int) cand_.size());
    std::partial_sort(cand_.begin(), cand_.begin() + k, cand_.end(), [](const candidate & a, const candidate & b) {
        return better(a.logit, a.id, b.logit, b.id);
    });
    cand_.resize(k);
}

void token_sampler::dense_top_k(int k) {
    // one pass over work_ with a heap of the k best so far (ordered by `better`, so its worst is at the front):
    // most tokens are turned away by one comparison with it
    const auto ahead = [](const candidate & a, const candidate & b) { return better(a.logit, a.id, b.logit, b.id); };
    cand_.clear();
    for (int64_t i = 0; i < n_vocab_; ++i) {
        if ((int) cand_.size() < k) {
            cand_.push_back({work_[i], (int32_t) i});
            std::push_heap(cand_.begin(), cand_.end(), ahead);
        } else if (work_[i] > cand_.front().logit) {  // (a tie goes to the earlier, lower id, already in)
            std::pop_heap(cand_.begin(), cand_.end(), ahead);
            cand_.back() = {work_[i], (int32_t) i};
            std::push_heap(cand_.begin(), cand_.end(), ahead);
        }
    }
    std::sort(cand_.begin(), cand_.end(), ahead);  // best first, as select_top_k leaves them
    dense_ = false;
}

void token_sampler::softmax(double temperature) {
    float max_l = NEG_INF;
    for (const candidate & c : cand_) {
        max_l = std::max(max_l, c.logit);
    }
    probs_.resize(cand_.size());
    scratch_.resize(cand_.size());
    for (size_t i = 0; i < cand_.size(); ++i) {
        scratch_[i] = cand_[i].logit;
    }
    // all -inf (every candidate banned): an even draw among them
    if (max_l == NEG_INF) {
        std::fill(scratch_.begin(), scratch_.end(), 1.0f);
    } else {
        exp_shifted(scratch_.data(), max_l, (float) (1.0 / temperature), scratch_.data(), scratch_.size());
    }
    double sum = 0.0;
    for (float w : scratch_) {
        sum += w;
    }
    for (size_t i = 0; i < cand_.size(); ++i) {
        probs_[i] = scratch_[i] / sum;
    }
}

void token_sampler::restore_id_order() {
    if (cand_.size() * 32 < (size_t) n_vocab_) {
        std::sort(cand_.begin(), cand_.end(), [](const candidate & a, const candidate & b) { return a.id < b.id; });
        return;
    }
    // most of the vocabulary: mark and scan instead of sorting; the candidates' logits are those in work_
    kept_.assign((size_t) n_vocab_, 0);
    for (const candidate & c : cand_) {
        kept_[c.id] = 1;
    }
    size_t n = 0;
    for (int64_t id = 0; id < n_vocab_; ++id) {
        if (kept_[id]) {
            cand_[n++] = {work_[id], (int32_t) id};
        }
    }
}

void token_sampler::keep_typical(float p) {
    // llama.cpp: tokens by |-log p - entropy| ascending, kept until their mass exceeds p (at least one)
    softmax(1.0);
    double entropy = 0.0;
    for (double q : probs_) {
        entropy -= q > 0.0 ? q * std::log(q) : 0.0;
    }
    std::vector<size_t> order(cand_.size());
    std::vector<double> shifted(cand_.size());
    for (size_t i = 0; i < cand_.size(); ++i) {
        order[i]   = i;
        shifted[i] = probs_[i] > 0.0 ? std::fabs(-std::log(probs_[i]) - entropy) : std::numeric_limits<double>::infinity();
    }
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return shifted[a] != shifted[b] ? shifted[a] < shifted[b] : cand_[a].id < cand_[b].id;
    });
    double cum  = 0.0;
    size_t keep = order.size();
    for (size_t i = 0; i < order.size(); ++i) {
        cum += probs_[order[i]];
        if (cum > p) {
            keep = i + 1;
            break;
        }
    }
    std::vector<candidate> kept(keep);
    for (size_t i = 0; i < keep; ++i) {
        kept[i] = cand_[order[i]];
    }
    cand_ = std::move(kept);
}

void token_sampler::keep_top_p(float p) {
    // the smallest set of most likely tokens whose probabilities sum to at least p (at least one), on an
    // explicit list (after top-k: short; a wide set stays dense, dense_top_p)
    softmax(1.0);
    std::vector<std::pair<candidate, double>> & both = edge_;
    both.resize(cand_.size());
    for (size_t i = 0; i < cand_.size(); ++i) {
        both[i] = {cand_[i], probs_[i]};
    }
    std::sort(both.begin(), both.end(), [](const auto & a, const auto & b) {
        return better(a.first.logit, a.first.id, b.first.logit, b.first.id);
    });
    double cum = 0.0;
    size_t n   = 0;
    while (n < both.size()) {
        cand_[n] = both[n].first;
        cum += both[n++].second;
        if (cum >= p) {
            break;
        }
    }
    cand_.resize(n);
}

void token_sampler::dense_top_p(float p) {
    // top-p on the whole vocabulary, in place (excluded tokens' logits become -inf). A flat distribution's
    // nucleus can hold most of a 150K vocabulary (sorting it took 15 ms), so the tokens go into bins by logit
    // below the maximum, the bins' masses are summed from the top down to the one where p is reached, and only
    // that bin is sorted.
    const size_t n     = work_.size();
    float *      w     = work_.data();
    float        min_l = std::numeric_limits<float>::infinity();
#pragma omp simd reduction(min : min_l)
    for (size_t i = 0; i < n; ++i) {
        const float finite = w[i] > NEG_INF ? w[i] : std::numeric_limits<float>::infinity();
        min_l              = finite < min_l ? finite : min_l;
    }
    const float per_logit = std::max((float) (TOP_P_BINS - 1) / std::max(max_l_ - min_l, 1e-30f),
                                     1.0f / TOP_P_MAX_BIN_WIDTH);
    bins_.resize(n);
    int32_t *   bin  = bins_.data();
    const float last = (float) (TOP_P_BINS - 1);
    const float top  = max_l_;
#pragma omp simd
    for (size_t i = 0; i < n; ++i) {
        const float below = (top - w[i]) * per_logit;  // +inf for -inf logits
        bin[i]            = (int32_t) (below < last ? below : last);
    }
    scratch_.resize(n);
    exp_shifted(w, max_l_, 1.0f, scratch_.data(), n);
    std::vector<double> & mass = bin_mass_;
    mass.assign(TOP_P_BINS, 0.0);
    double total = 0.0;
    for (size_t i = 0; i < n; ++i) {
        mass[bin[i]] += scratch_[i];
    }
    for (double m : mass) {
        total += m;
    }
    const double target   = p * total;
    double       above    = 0.0;
    int          boundary = TOP_P_BINS - 1;
    for (int b = 0; b < TOP_P_BINS; ++b) {
        if (above + mass[b] >= target) {
            boundary = b;
            break;
        }
        above += mass[b];
    }
    std::vector<std::pair<candidate, double>> & edge = edge_;
    edge.clear();
    for (size_t i = 0; i < n; ++i) {
        if (bin[i] == boundary) {
            edge.push_back({{w[i], (int32_t) i}, scratch_[i]});
        }
    }
#pragma omp simd
    for (size_t i = 0; i < n; ++i) {
        w[i] = bin[i] > boundary ? NEG_INF : w[i];
    }
    std::sort(edge.begin(), edge.end(), [](const auto & a, const auto & b) {
        return better(a.first.logit, a.first.id, b.first.logit, b.first.id);
    });
    size_t j = 0;  // the edge's tokens kept: up to the one where the running sum reaches the target
    while (j < edge.size()) {
        above += edge[j++].second;
        if (above >= target) {
            break;
        }
    }
    for (; j < edge.size(); ++j) {
        work_[edge[j].first.id] = NEG_INF;
    }
}

void token_sampler::keep_min_p(float p) {
    // tokens whose probability is at least p times the most likely one's: logit >= max + log p
    float max_l = NEG_INF;
    for (const candidate & c : cand_) {
        max_l = std::max(max_l, c.logit);
    }
    const float min_l = max_l + std::log(p);
    size_t      n     = 0;
    for (const candidate & c : cand_) {
        if (c.logit >= min_l) {
            cand_[n++] = c;
        }
    }
    if (n > 0) {  // (all -inf: nothing to compare; keep them)
        cand_.resize(n);
    }
}

void token_sampler::dense_min_p(float p) {
    const float min_l = max_l_ + std::log(p);
#pragma omp simd
    for (size_t i = 0; i < work_.size(); ++i) {
        work_[i] = work_[i] >= min_l ? work_[i] : NEG_INF;
    }
}

void token_sampler::record_logprobs(const float * logits, int32_t token) {
    float max_l = NEG_INF;
    for (int64_t i = 0; i < n_vocab_; ++i) {
        max_l = std::max(max_l, logits[i]);  // NaN never wins
    }
    double sum = 0.0;
    for (int64_t i = 0; i < n_vocab_; ++i) {
        sum += std::isnan(logits[i]) ? 0.0 : std::exp((double) (logits[i] - max_l));
    }
    const double lse  = max_l + std::log(sum);
    logprobs_.logprob = (float) (logits[token] - lse);
    logprobs_.top.clear();
    if (p_.n_logprobs > 0) {
        std::vector<candidate> all((size_t) n_vocab_);
        for (int64_t i = 0; i < n_vocab_; ++i) {
            all[i] = {std::isnan(logits[i]) ? NEG_INF : logits[i], (int32_t) i};
        }
        const size_t k = std::min<size_t>(p_.n_logprobs, all.size());
        std::partial_sort(all.begin(), all.begin() + k, all.end(), [](const candidate & a, const candidate & b) {
            return better(a.logit, a.id, b.logit, b.id);
        });
        for (size_t i = 0; i < k; ++i) {
            logprobs_.top.emplace_back(all[i].id, (float) (all[i].logit - lse));
        }
    }
}

void token_sampler::load_logits(const float * logits, const uint32_t * allowed) {
    work_.resize((size_t) n_vocab_);
    float * w = work_.data();
#pragma omp simd
    for (int64_t i = 0; i < n_vocab_; ++i) {
        // NaN is never drawn; +inf (garbage too) is kept finite so that differences to it stay numbers
        const float x = logits[i];
        w[i]          = x != x ? NEG_INF : x < std::numeric_limits<float>::max() ? x : std::numeric_limits<float>::max();
    }
    if (allowed) {
        for (int64_t i = 0; i < n_vocab_; ++i) {
            w[i] = allowed[i >> 5] >> (i & 31) & 1u ? w[i] : NEG_INF;
        }
    }
    apply_bias_and_penalties();
    float max_l = NEG_INF;
#pragma omp simd reduction(max : max_l)
    for (int64_t i = 0; i < n_vocab_; ++i) {
        max_l = w[i] > max_l ? w[i] : max_l;
    }
    max_l_ = max_l;
}

bool token_sampler::truncate_candidates() {
    // Wide candidate sets stay dense (work_ by id, excluded tokens at -inf: nothing is sorted or copied); a
    // top-k, typical-p or every token banned (an even draw among them) make them an explicit list
    dense_         = max_l_ > NEG_INF;
    bool reordered = false;
    if (!dense_) {
        materialize_all();
    }
    if (p_.top_k > 0 && p_.top_k < n_vocab_) {
        if (dense_) {
            dense_top_k(p_.top_k);
        } else {
            select_top_k(p_.top_k);
        }
        reordered = true;
    }
    if (p_.typical_p < 1.0f) {
        if (dense_) {
            materialize_all();
        }
        keep_typical(p_.typical_p);
        reordered = true;
    }
    if (p_.top_p < 1.0f) {
        if (dense_) {
            dense_top_p(p_.top_p);
        } else {
            keep_top_p(p_.top_p);
            reordered = true;
        }
    }
    if (p_.min_p > 0.0f) {
        if (dense_) {
            dense_min_p(p_.min_p);
        } else {
            keep_min_p(p_.min_p);
        }
    }
    if (p_.temperature <= 0.0f) {  // greedy over what is left
        if (dense_) {
            const int32_t best = (int32_t) (std::max_element(work_.begin(), work_.end()) - work_.begin());
            cand_.assign(1, {work_[best], best});
            dense_ = false;
        } else {
            select_top_k(1);
        }
    }
    return reordered;
}

void token_sampler::compute_weights(bool reordered) {
    // the weights e^((logit - max) / T), by id (1 / T bounded: a subnormal T would make 0 * inf of the maximum)
    const float inv_t = p_.temperature > 0.0f ? std::min(1.0f / p_.temperature, std::numeric_limits<float>::max())
                                              : 1.0f;
    if (dense_) {
        weights_.resize(work_.size());
        exp_shifted(work_.data(), max_l_, inv_t, weights_.data(), work_.size());
    } else {
        if (reordered) {
            restore_id_order();
        }
        softmax(1.0 / inv_t);
        weights_.assign(probs_.begin(), probs_.end());
    }
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (size_t i = 0; i < weights_.size(); ++i) {
        total += weights_[i];
    }
    total_ = total;
}

int32_t token_sampler::sample(const float * logits, uint64_t t, const uint32_t * allowed) {
    load_logits(logits, allowed);
    compute_weights(truncate_candidates());
    const size_t  pick  = draw_two_level(draw_key(p_.seed, t));
    const int32_t token = dense_ ? (int32_t) pick : cand_[pick].id;
    if (p_.n_logprobs >= 0 && p_.post_sampling_probs) {
        record_draw_probs(token);
    } else if (p_.n_logprobs >= 0) {
        record_logprobs(logits, token);
    }
    return token;
}

void token_sampler::record_draw_probs(int32_t token) {
    logprobs_.logprob = (float) std::log(probability(token));
    logprobs_.top.clear();
    if (p_.n_logprobs > 0) {
        std::vector<std::pair<int32_t, double>> all = distribution();
        const size_t k = std::min<size_t>(p_.n_logprobs, all.size());
        std::partial_sort(all.begin(), all.begin() + k, all.end(), [](const auto & a, const auto & b) {
            return a.second > b.second || (a.second == b.second && a.first < b.first);
        });
        for (size_t i = 0; i < k && all[i].second > 0.0; ++i) {
            logprobs_.top.emplace_back(all[i].first, (float) std::log(all[i].second));
        }
    }
}

size_t token_sampler::draw_two_level(uint64_t key) const {
    const auto id_of = [&](size_t i) { return dense_ ? (int32_t) i : cand_[i].id; };
    const size_t n   = weights_.size();
    // level 1: the block of ids, Gumbel-max over the blocks' log-masses
    double best_score = -std::numeric_limits<double>::infinity();
    size_t best_begin = 0, best_end = 0;
    for (size_t begin = 0; begin < n;) {
        const int32_t block = id_of(begin) >> DRAW_BLOCK_BITS;
        size_t        end   = begin;
        if (dense_) {  // ids are the indices
            end = std::min(n, ((size_t) block + 1) << DRAW_BLOCK_BITS);
        }
        while (end < n && (id_of(end) >> DRAW_BLOCK_BITS) == block) {
            ++end;
        }
        float mass = 0.0f;
#pragma omp simd reduction(+ : mass)
        for (size_t i = begin; i < end; ++i) {
            mass += weights_[i];
        }
        if (mass > 0.0f) {
            const double score = std::log((double) mass) + draw_gumbel(key, DRAW_BLOCK_KEY + (uint64_t) block);
            if (score > best_score) {
                best_score = score;
                best_begin = begin;
                best_end   = end;
            }
        }
        begin = end;
    }
    // level 2: the token within the block, Gumbel-max over its log-weights
    best_score  = -std::numeric_limits<double>::infinity();
    size_t pick = best_begin;
    for (size_t i = best_begin; i < best_end; ++i) {
        if (weights_[i] > 0.0f) {
            const double score = std::log((double) weights_[i]) + draw_gumbel(key, (uint64_t) id_of(i));
            if (score > best_score) {
                best_score = score;
                pick       = i;
            }
        }
    }
    return pick;
}

double token_sampler::probability(int32_t token) const {
    if (dense_) {
        return token >= 0 && token < (int32_t) weights_.size() ? weights_[token] / total_ : 0.0;
    }
    const auto it = std::lower_bound(cand_.begin(), cand_.end(), token,
                                     [](const candidate & c, int32_t id) { return c.id < id; });
    return it != cand_.end() && it->id == token ? weights_[it - cand_.begin()] / total_ : 0.0;
}

std::vector<std::pair<int32_t, double>> token_sampler::distribution() const {
    std::vector<std::pair<int32_t, double>> out;
    for (size_t i = 0; i < weights_.size(); ++i) {
        if (!dense_ || weights_[i] > 0.0f) {  // dense: excluded tokens are not candidates
            out.emplace_back(dense_ ? (int32_t) i : cand_[i].id, weights_[i] / total_);
        }
    }
    return out;
}

}  // namespace pdf
