#include "state/eval_batcher.h"
#include "core/clock.h"
#include "core/log.h"
#include "state/step_plan.h"

#include <algorithm>

namespace pdf {

// the batch's cool-down (judge): as a generation's own (decode/proposer.cpp), in steps
static constexpr double   SLOWER_THAN_PLAIN = 0.02;
static constexpr double   CLEARLY_FASTER    = 0.05;
static constexpr uint64_t COOLDOWN_MIN      = 4;
static constexpr uint64_t COOLDOWN_MAX      = 2048;

namespace {
thread_local double waited_here = 0.0;  // eval_batcher::waited_ms()
}

double eval_batcher::waited_ms() {
    return waited_here;
}

eval_batcher::eval_batcher(std::shared_ptr<const target_model> model)
    : row_tile_(model->verify_row_tile()), batch_(std::move(model)) {}

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
    p.s->eval(p.tokens, p.n, p.layout, p.what, p.capture, p.rings);
    return ms_since(t0);
}

double eval_batcher::eval(const session_batch::part & part) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (alone()) {
        counts_.alone++;
        steps_++;
        drafted_ms_ = 0.0;
        lock.unlock();
        return eval_alone(part);
    }
    request me;
    me.part = &part;
    waiting_.push_back(&me);
    if (!offers_.empty() || !drafts_.empty()) {
        done_.notify_all();  // this part may complete what the offers' plan or the drafts wait for
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
            const bool split    = one_by_one(group);
            const bool batched  = !split && run(group, batch_ms);
            if (split) {
                run_one_by_one(group, true);
            }
            lock.lock();
            counts_.one_by_one += split;
            counts_.batches += batched;
            steps_++;
            drafted_ms_ = 0.0;  // (a step whose drafts no plan judged: chain and tree modes)
            counts_.batched_parts += batched ? group.size() : 0;
            counts_.alone += batched ? 0 : group.size();
            counts_.batched_ms += batch_ms;
            counts_.max_rows = std::max<uint64_t>(counts_.max_rows, batched ? rows : 0);
            counts_.step_shapes = times_.shapes();  // (its leader is done with times_)
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

device_bytes eval_batcher::compute_memory() const {
    std::lock_guard<std::mutex> lock(mutex_);
    device_bytes                total = batch_.compute_memory();
    for (const auto & [drafter, batch] : draft_batches_) {
        const device_bytes more = batch->compute_memory();
        total.cpu += more.cpu;
        total.gpu += more.gpu;
    }
    if (head_batch_) {
        const device_bytes more = head_batch_->compute_memory();
        total.cpu += more.cpu;
        total.gpu += more.gpu;
    }
    return total;
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

int eval_batcher::plan(const std::vector<double> & gains) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (alone()) {
        return -1;
    }
    offer me;
    me.gains = &gains;
    offers_.push_back(&me);
    done_.notify_all();  // (the drafts wait for every member's draft, offer or part)
    while (!me.done) {
        if (!running_ && drafts_.empty() && (int) (offers_.size() + waiting_.size()) >= members_) {
            plan_offers();  // the step is known: plan it
            done_.notify_all();
        } else {
            const auto t0 = clock_type::now();
            done_.wait(lock);
            waited_here += ms_since(t0);
        }
    }
    return me.width;
}

const draft_proposals & eval_batcher::draft(draft_session & d, int32_t anchor, int start, int n_block) {
    draft_request me;
    me.part = {&d, anchor, start, n_block};
    return draft_in_step(me) ? d.proposals() : d.draft(anchor, start, n_block);
}

const draft_proposals & eval_batcher::draft_head(mtp_session & h, bool first, int32_t anchor, int start, int h_row) {
    draft_request me;
    me.head = {&h, first, anchor, start, h_row};
    if (draft_in_step(me)) {
        return h.proposals();
    }
    return first ? h.begin(anchor, start, h_row) : h.next();
}

bool eval_batcher::draft_in_step(draft_request & me) {
    const auto                   t0 = clock_type::now();
    std::unique_lock<std::mutex> lock(mutex_);
    if (alone()) {
        return false;
    }
    drafts_.push_back(&me);
    done_.notify_all();
    while (!me.done) {
        if (!running_ && (int) (drafts_.size() + offers_.size() + waiting_.size()) >= members_) {
            std::vector<draft_request *> group;  // every member has drafted, offered or handed in its part
            group.swap(drafts_);
            running_ = true;
            lock.unlock();
            const auto [drafts, heads] = run_drafts(group);
            lock.lock();
            for (const draft_request * r : group) {
                drafted_ms_ += r->share_ms;
                const bool head = r->head.h != nullptr;
                counts_.batched_drafts += !head && drafts;
                counts_.batched_head_steps += head && heads;
            }
            counts_.draft_batches += drafts;
            counts_.head_batches += heads;
            running_ = false;
            for (draft_request * r : group) {
                r->done = true;
            }
            done_.notify_all();
        } else {
            done_.wait(lock);
        }
    }
    waited_here += std::max(0.0, ms_since(t0) - me.share_ms);
    if (me.error) {
        std::rethrow_exception(me.error);
    }
    return true;
}

std::pair<bool, bool> eval_batcher::run_drafts(const std::vector<draft_request *> & group) {
    // drafts of one drafter and one block length share a graph, and the MTP head's steps at step 0 and past it
    // theirs; the rest draft alone
    std::map<std::pair<const void *, int>, std::vector<draft_request *>> kinds;
    for (draft_request * r : group) {
        if (r->head.h) {
            kinds[{r->head.h->shared_target().get(), r->head.first ? -1 : -2}].push_back(r);
        } else {
            kinds[{&r->part.d->model(), draft_batch::block_of(r->part)}].push_back(r);
        }
    }
    bool drafts = false, heads = false;
    for (auto & [kind, requests] : kinds) {
        const bool head     = kind.second < 0;
        const bool together = requests.size() > 1 && (head ? heads_together(requests) : draft_together(requests));
        (head ? heads : drafts) = (head ? heads : drafts) || together;
        for (draft_request * r : requests) {
            if (!together) {
                draft_alone(*r);
            }
        }
    }
    return {drafts, heads};
}

// batch.draft(parts) over the requests' parts, each request charged an equal share of its time; false: it failed
// (logged), and they draft alone, where each one's error (a bad anchor, a position) is its member's
template <class Batch, class Part, class Request>
static bool draft_in_one_graph(Batch & batch, const std::vector<Part> & parts,
                               const std::vector<Request *> & requests) {
    try {
        const auto t0 = clock_type::now();
        batch.draft(parts);
        const double ms = ms_since(t0);
        for (Request * r : requests) {
            r->share_ms = ms / requests.size();
        }
        return true;
    } catch (const std::exception & e) {
        PDF_LOG_DEBUG("a draft batch of %zu failed (%s): drafting them one by one", requests.size(), e.what());
    } catch (...) {
    }
    return false;
}

bool eval_batcher::draft_together(const std::vector<draft_request *> & requests) {
    std::vector<draft_batch::part> parts;
    for (const draft_request * r : requests) {
        parts.push_back(r->part);
    }
    std::unique_ptr<draft_batch> & batch = draft_batches_[&parts[0].d->model()];
    if (!batch) {
        batch = std::make_unique<draft_batch>(parts[0].d->shared_model());
    }
    return batch->batches(parts) && draft_in_one_graph(*batch, parts, requests);
}

bool eval_batcher::heads_together(const std::vector<draft_request *> & requests) {
    std::vector<mtp_batch::part> parts;
    for (const draft_request * r : requests) {
        parts.push_back(r->head);
    }
    if (!head_batch_) {
        head_batch_ = std::make_unique<mtp_batch>(parts[0].h->shared_target());
    }
    return head_batch_->batches(parts) && draft_in_one_graph(*head_batch_, parts, requests);
}

void eval_batcher::draft_alone(draft_request & r) {
    try {
        const auto t0 = clock_type::now();
        if (r.head.h) {
            r.head.first ? r.head.h->begin(r.head.anchor, r.head.start, r.head.h_row) : r.head.h->next();
        } else {
            r.part.d->draft(r.part.anchor, r.part.start, r.part.n_block);
        }
        r.share_ms = ms_since(t0);
    } catch (...) {
        r.error = std::current_exception();
    }
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
    const step_plan plan = plan_step(gains, fixed, times_, row_tile_);
    counts_.planned += plan.widths.empty() ? 0 : 1;
    for (size_t i = 0; i < offers_.size(); ++i) {
        offers_[i]->width = plan.widths.empty() ? -1 : plan.widths[i];
        offers_[i]->done  = true;
    }
    offers_.clear();
    if (!plan.widths.empty()) {
        judge(plan);
    }
}

void eval_batcher::judge(const step_plan & plan) {
    // the plan's expected rate with this step's drafting (sunk when it planned, not when deciding to draft)
    // against plain decoding's: behind it, the batch's generations draft nothing for a cool-down that doubles
    // each time (up to COOLDOWN_MAX steps), all of them from the same step on and back at the same step;
    // clearly ahead, the next cool-down is the shortest again
    const double spec  = plan.tokens / (plan.ms + drafted_ms_);
    const double plain = plan.plain_tokens / plan.plain_ms;
    if (spec < (1.0 - SLOWER_THAN_PLAIN) * plain) {
        cool_until_ = steps_.load() + std::max(cool_len_, COOLDOWN_MIN);
        cool_len_   = std::min(2 * std::max(cool_len_, COOLDOWN_MIN), COOLDOWN_MAX);
        counts_.cooldowns++;
    } else if (spec > (1.0 + CLEARLY_FASTER) * plain) {
        cool_len_ = COOLDOWN_MIN;
    }
}

bool eval_batcher::sits_out() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return steps_.load() < cool_until_;
}

bool eval_batcher::alone() const {
    return members_ <= 1 && waiting_.empty() && offers_.empty() && drafts_.empty() && !running_;
}

bool eval_batcher::shared() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return members_ > 1;
}

bool eval_batcher::one_by_one(const std::vector<request *> & group) {
    for (const request * r : group) {
        if (r->part->n != 1 || r->part->layout.whole) {
            return false;
        }
    }
    const int    parts    = (int) group.size();
    const double together = times_.settled(parts, parts), alone = times_.settled(1, 1);
    if (parts < 2 || together <= 0) {
        return false;  // (together first: what the plans weigh)
    }
    if (alone <= 0) {
        return true;
    }
    const bool cheaper = parts * alone < together;
    return ++plain_steps_ % RECHECK_EVERY == 0 ? !cheaper : cheaper;
}

void eval_batcher::run_one_by_one(const std::vector<request *> & group, bool learn) {
    for (request * r : group) {
        try {
            r->ms = eval_alone(*r->part);
            if (learn) {
                times_.split({1}, r->ms, true);  // (a plain part alone: learnt as a step of 1 part and 1 row)
            }
        } catch (...) {
            r->error = std::current_exception();
        }
    }
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
    run_one_by_one(group, false);
    return false;
}

std::map<int, std::map<int, double>> eval_batcher::step_times_measured() const {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return !running_; });  // (a leader writes times_ unlocked while running_)
    return times_.measured();
}

void eval_batcher::restore_step_times(const std::map<int, std::map<int, double>> & table) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return !running_; });
    times_.restore(table);  // (checked before anything changes)
    counts_.step_shapes = times_.shapes();
}

eval_batcher::counts eval_batcher::stats() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return counts_;
}

}  // namespace pdf
