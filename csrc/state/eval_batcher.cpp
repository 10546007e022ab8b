#include "state/eval_batcher.h"
#include "core/clock.h"
#include "core/log.h"
#include "state/step_plan.h"

#include <algorithm>

namespace pdf {

eval_batcher::eval_batcher(std::shared_ptr<const target_model> model) : batch_(std::move(model)) {}

eval_batcher::member::member(eval_batcher & b) : b_(b) {
    const std::lock_guard<std::mutex> lock(b_.mutex_);
    b_.members_++;
}

eval_batcher::member::~member() {
    {
        const std::lock_guard<std::mutex> lock(b_.mutex_);
        b_.members_--;
    }
    b_.done_.notify_all();  // the waiting parts may be the whole step now
}

static double eval_alone(const session_batch::part & p) {
    const auto t0 = clock_type::now();
    p.s->eval(p.tokens, p.n, p.layout, p.what, p.capture, p.ring);
    return ms_since(t0);
}

double eval_batcher::eval(const session_batch::part & part) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (members_ <= 1 && waiting_.empty() && !running_) {
        counts_.alone++;
        lock.unlock();
        return eval_alone(part);
    }
    request me;
    me.part = &part;
    waiting_.push_back(&me);
    if (!offers_.empty()) {
        done_.notify_all();  // this part may complete what the offers' plan waits for
    }
    while (!me.done) {
        if (!running_ && (int) waiting_.size() >= members_) {  // every member's part is in: this one leads
            std::vector<request *> group = take_step();
            running_ = true;
            lock.unlock();
            int rows = 0;
            for (const request * r : group) {
                rows += r->part->n;
            }
            double     batch_ms = 0.0;
            const bool batched  = run(group, batch_ms);
            lock.lock();
            counts_.batches += batched;
            counts_.batched_parts += batched ? group.size() : 0;
            counts_.alone += batched ? 0 : group.size();
            counts_.batched_ms += batch_ms;
            counts_.max_rows = std::max<uint64_t>(counts_.max_rows, batched ? rows : 0);
            running_ = false;
            for (request * r : group) {
                r->done = true;
            }
            done_.notify_all();
        } else {
            done_.wait(lock);
        }
    }
    if (me.error) {
        std::rethrow_exception(me.error);
    }
    return me.ms;
}

std::vector<bool> eval_batcher::next_step() const {
    // Every decoding stream's part (a token, a chain, a tree: at most a verify's width each), and prompt
    // micro-batches up to two of them (their rows within 2 x n_ubatch), the longest-waiting first: a step's
    // prompt work stays near what one session's prefill holds in its compute buffer, and decoding streams wait
    // at most that long for their next token; a prompt part left out goes first at the next step.
    int cap = 0;
    for (const request * r : waiting_) {
        cap = std::max(cap, 2 * (int) r->part->s->n_ubatch());
    }
    std::vector<bool> taken;
    int               prompt_rows = 0;
    for (const request * r : waiting_) {  // (in the order they came)
        const bool prompt = r->part->layout.whole;
        taken.push_back(!prompt || taken.empty() || prompt_rows + r->part->n <= cap);
        prompt_rows += prompt && taken.back() ? r->part->n : 0;
    }
    return taken;
}

std::vector<eval_batcher::request *> eval_batcher::take_step() {
    const std::vector<bool> taken = next_step();
    std::vector<request *>  step, left;
    for (size_t i = 0; i < waiting_.size(); ++i) {
        (taken[i] ? step : left).push_back(waiting_[i]);
    }
    waiting_.swap(left);
    return step;
}

int eval_batcher::plan(const std::vector<double> & gains, double & waited_ms) {
    waited_ms = 0.0;
    std::unique_lock<std::mutex> lock(mutex_);
    if (members_ <= 1 && waiting_.empty() && offers_.empty() && !running_) {
        return -1;
    }
    offer me;
    me.gains = &gains;
    offers_.push_back(&me);
    while (!me.done) {
        if (!running_ && (int) (offers_.size() + waiting_.size()) >= members_) {  // the step is known: plan it
            plan_offers();
            done_.notify_all();
        } else {
            const auto t0 = clock_type::now();
            done_.wait(lock);
            waited_ms += ms_since(t0);
        }
    }
    return me.width;
}

void eval_batcher::plan_offers() {
    fixed_parts             fixed;
    const std::vector<bool> taken = next_step();
    for (size_t i = 0; i < waiting_.size(); ++i) {
        if (taken[i] && !waiting_[i]->part->layout.whole) {
            fixed.parts++;
            fixed.rows += waiting_[i]->part->n;
        }
    }
    std::vector<const std::vector<double> *> gains;
    for (const offer * o : offers_) {
        gains.push_back(o->gains);
    }
    const std::vector<int> widths = plan_step(gains, fixed, times_);
    counts_.planned += widths.empty() ? 0 : 1;
    for (size_t i = 0; i < offers_.size(); ++i) {
        offers_[i]->width = widths.empty() ? -1 : widths[i];
        offers_[i]->done  = true;
    }
    offers_.clear();
}

bool eval_batcher::run(const std::vector<request *> & group, double & batch_ms) {
    if (group.size() > 1) {
        std::vector<session_batch::part> parts;
        for (const request * r : group) {
            parts.push_back(*r->part);
        }
        try {
            const auto t0 = clock_type::now();
            batch_.eval(parts);
            const double ms = ms_since(t0);
            // each part's share (state/step_times.h): what its generation's cost model weighs
            std::vector<int> part_rows;
            bool             decoding = true;
            for (const request * r : group) {
                part_rows.push_back(r->part->n);
                decoding = decoding && !r->part->layout.whole;
            }
            const std::vector<double> shares = times_.split(part_rows, ms, decoding);
            for (size_t i = 0; i < group.size(); ++i) {
                group[i]->ms = shares[i];
            }
            batch_ms = ms;
            return true;
        } catch (const std::exception & e) {
            // evaluated alone below: each part's error (a context overflow, a bad token) is its member's
            PDF_LOG_DEBUG("a batch of %zu parts failed (%s): evaluating them one by one", group.size(), e.what());
        } catch (...) {
            // (likewise: nothing may leave the step with the batcher marked running)
        }
    }
    for (request * r : group) {
        try {
            r->ms = eval_alone(*r->part);
        } catch (...) {
            r->error = std::current_exception();
        }
    }
    return false;
}

eval_batcher::counts eval_batcher::stats() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return counts_;
}

}  // namespace pdf
