#include "state/eval_batcher.h"
#include "core/clock.h"

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
    while (!me.done) {
        if (!running_ && (int) waiting_.size() >= members_) {  // every member's part is in: this one leads
            std::vector<request *> group;
            group.swap(waiting_);
            running_ = true;
            lock.unlock();
            const bool batched = run(group);
            lock.lock();
            counts_.batches += batched;
            counts_.batched_parts += batched ? group.size() : 0;
            counts_.alone += batched ? 0 : group.size();
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

bool eval_batcher::run(const std::vector<request *> & group) {
    if (group.size() > 1) {
        std::vector<session_batch::part> parts;
        for (const request * r : group) {
            parts.push_back(*r->part);
        }
        try {
            const auto t0 = clock_type::now();
            batch_.eval(parts);
            const double ms = ms_since(t0);
            for (request * r : group) {
                r->ms = ms;
            }
            return true;
        } catch (const std::exception &) {
            // evaluated alone below: each part's error (a context overflow, a bad token) is its member's
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
