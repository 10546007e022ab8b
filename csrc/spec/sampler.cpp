#include "spec/sampler.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace pdf {

// the draw's first level groups token ids in blocks of 2^DRAW_BLOCK_BITS; block noise is keyed apart from tokens
static constexpr int      DRAW_BLOCK_BITS = 8;
static constexpr uint64_t DRAW_BLOCK_KEY  = 1ull << 40;

// top-p first looks among this many of the most likely candidates (llama.cpp's adaptive partial sort), and
// sorts the rest only when their probabilities do not reach p
static constexpr size_t TOP_P_FIRST_LOOK = 256;

static constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

bool sampling_params::penalties_on() const {
    return repeat_last_n != 0 && (repeat_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f);
}

bool sampling_params::needs_logits() const {
    return temperature > 0.0f || penalties_on() || !logit_bias.empty() || n_logprobs >= 0 || typical_p < 1.0f;
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
    for (const auto & [id, bias] : p_.logit_bias) {
        work_[id] += bias;
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
        l -= (float) c * p_.frequency_penalty + p_.presence_penalty;
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

void token_sampler::select_top_k(int k) {
    k = std::min<int>(k, (int) cand_.size());
    std::partial_sort(cand_.begin(), cand_.begin() + k, cand_.end(), [](const candidate & a, const candidate & b) {
        return better(a.logit, a.id, b.logit, b.id);
    });
    cand_.resize(k);
}

void token_sampler::softmax(double temperature) {
    float max_l = NEG_INF;
    for (const candidate & c : cand_) {
        max_l = std::max(max_l, c.logit);
    }
    probs_.resize(cand_.size());
    double sum = 0.0;
    for (size_t i = 0; i < cand_.size(); ++i) {
        // all -inf (every candidate banned): an even draw among them
        probs_[i] = max_l == NEG_INF ? 1.0 : std::exp((double) (cand_[i].logit - max_l) / temperature);
        sum += probs_[i];
    }
    for (double & q : probs_) {
        q /= sum;
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
    // the smallest set of most likely tokens whose probabilities sum to at least p (at least one)
    softmax(1.0);
    const auto by_prob = [](const candidate & a, const candidate & b) { return better(a.logit, a.id, b.logit, b.id); };
    // probabilities follow the logits, so sorting by logit sorts by probability; keep probs_ aligned
    std::vector<std::pair<candidate, double>> both(cand_.size());
    for (size_t i = 0; i < cand_.size(); ++i) {
        both[i] = {cand_[i], probs_[i]};
    }
    const auto cmp = [&](const auto & a, const auto & b) { return by_prob(a.first, b.first); };
    size_t sorted = std::min(TOP_P_FIRST_LOOK, both.size());
    std::partial_sort(both.begin(), both.begin() + sorted, both.end(), cmp);
    double cum  = 0.0;
    size_t keep = both.size();
    for (size_t i = 0; i < both.size(); ++i) {
        if (i == sorted) {  // the first look fell short: sort the rest
            std::sort(both.begin() + sorted, both.end(), cmp);
            sorted = both.size();
        }
        cum += both[i].second;
        if (cum >= p) {
            keep = i + 1;
            break;
        }
    }
    cand_.resize(keep);
    for (size_t i = 0; i < keep; ++i) {
        cand_[i] = both[i].first;
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

int32_t token_sampler::sample(const float * logits, uint64_t t) {
    work_.resize((size_t) n_vocab_);
    for (int64_t i = 0; i < n_vocab_; ++i) {
        work_[i] = std::isnan(logits[i]) ? NEG_INF : logits[i];
    }
    apply_bias_and_penalties();

    cand_.resize((size_t) n_vocab_);
    for (int64_t i = 0; i < n_vocab_; ++i) {
        cand_[i] = {work_[i], (int32_t) i};
    }
    if (p_.top_k > 0 && p_.top_k < n_vocab_) {
        select_top_k(p_.top_k);
    }
    if (p_.typical_p < 1.0f) {
        keep_typical(p_.typical_p);
    }
    if (p_.top_p < 1.0f) {
        keep_top_p(p_.top_p);
    }
    if (p_.min_p > 0.0f) {
        keep_min_p(p_.min_p);
    }
    if (p_.temperature <= 0.0f) {
        select_top_k(1);  // greedy over what is left
    }
    std::sort(cand_.begin(), cand_.end(), [](const candidate & a, const candidate & b) { return a.id < b.id; });
    softmax(p_.temperature > 0.0f ? p_.temperature : 1.0);
    const int32_t token = cand_[draw_two_level(probs_, cand_, draw_key(p_.seed, t))].id;
    if (p_.n_logprobs >= 0) {
        record_logprobs(logits, token);
    }
    return token;
}

size_t token_sampler::draw_two_level(const std::vector<double> & probs, const std::vector<candidate> & cand,
                                     uint64_t key) {
    // level 1: the block of ids, Gumbel-max over the blocks' log-masses
    double best_score = -std::numeric_limits<double>::infinity();
    size_t best_begin = 0, best_end = 0;
    for (size_t begin = 0; begin < cand.size();) {
        const int32_t block = cand[begin].id >> DRAW_BLOCK_BITS;
        double        mass  = 0.0;
        size_t        end   = begin;
        for (; end < cand.size() && (cand[end].id >> DRAW_BLOCK_BITS) == block; ++end) {
            mass += probs[end];
        }
        if (mass > 0.0) {
            const double score = std::log(mass) + draw_gumbel(key, DRAW_BLOCK_KEY + (uint64_t) block);
            if (score > best_score) {
                best_score = score;
                best_begin = begin;
                best_end   = end;
            }
        }
        begin = end;
    }
    // level 2: the token within the block, Gumbel-max over its log-probabilities
    best_score  = -std::numeric_limits<double>::infinity();
    size_t pick = best_begin;
    for (size_t i = best_begin; i < best_end; ++i) {
        if (probs[i] > 0.0) {
            const double score = std::log(probs[i]) + draw_gumbel(key, (uint64_t) cand[i].id);
            if (score > best_score) {
                best_score = score;
                pick       = i;
            }
        }
    }
    return pick;
}

double token_sampler::probability(int32_t token) const {
    const auto it = std::lower_bound(cand_.begin(), cand_.end(), token,
                                     [](const candidate & c, int32_t id) { return c.id < id; });
    return it != cand_.end() && it->id == token ? probs_[it - cand_.begin()] : 0.0;
}

std::vector<std::pair<int32_t, double>> token_sampler::distribution() const {
    std::vector<std::pair<int32_t, double>> out(cand_.size());
    for (size_t i = 0; i < cand_.size(); ++i) {
        out[i] = {cand_[i].id, probs_[i]};
    }
    return out;
}

}  // namespace pdf
