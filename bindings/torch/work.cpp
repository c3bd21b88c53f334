// The c10d::Work of the tandem backend and the group's completion thread.
//
// A work owns one td_request. Whoever completes it first settles the work: a caller's wait()
// (td_request_wait on the caller's thread, no hand-off), isCompleted() (td_request_test), or
// the completion thread once getFuture() handed the work over: DDP takes every bucket's future
// and waits on the future, never on the work, so someone else must complete the request. The
// thread completes handed works in call order, which is the order tandem runs a group's
// collectives in, so it never waits on one while a later one is done.
#include <ATen/core/jit_type.h>
#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "process_group.hpp"

namespace tandem_torch {

WorkTandem::WorkTandem(c10::intrusive_ptr<ProcessGroupTandem> pg, c10d::OpType type,
                       td_request *req, std::vector<at::Tensor> outputs,
                       std::vector<at::Tensor> keep, std::function<void()> after)
    : c10d::Work(pg->getRank(), type), pg_(std::move(pg)), req_(req), outputs_(std::move(outputs)),
      keep_(std::move(keep)), after_(std::move(after)) {}

WorkTandem::~WorkTandem() {
    // Dropped before anyone waited: tandem may still write into the tensors this work keeps
    // alive, so the request is finished here (bounded by the group's timeout).
    if (req_) (void)td_request_wait(req_);
}

void WorkTandem::settle(td_status status, std::string message) {
    std::exception_ptr error;
    if (status) {
        error = std::make_exception_ptr(std::runtime_error("tandem: " + message));
    } else if (after_) {
        try {
            after_();
        } catch (...) {
            error = std::current_exception();
        }
    }
    keep_.clear();
    after_ = nullptr;
    finish(error);
    if (future_) {
        if (error)
            future_->setError(error);
        else
            future_->markCompleted(c10::IValue(outputs_));
    }
}

void WorkTandem::complete() {
    std::lock_guard<std::mutex> guard(req_mutex_);
    if (!req_) return;
    td_request *req = req_;
    req_ = nullptr;
    td_status s = td_request_wait(req);
    settle(s, s ? td_last_error() : "");
}

bool WorkTandem::isCompleted() {
    std::unique_lock<std::mutex> guard(req_mutex_, std::try_to_lock);
    if (guard.owns_lock() && req_ && !handed_) {
        int done = 0;
        td_status s = td_request_test(req_, &done);
        if (done) {
            req_ = nullptr;
            settle(s, s ? td_last_error() : "");
        } else if (s) {
            // A failed test leaves the request to a later wait, which reports the failure.
            return false;
        }
    }
    return c10d::Work::isCompleted();
}

bool WorkTandem::wait(std::chrono::milliseconds timeout) {
    {
        std::lock_guard<std::mutex> guard(req_mutex_);
        if (req_ && !handed_ && timeout != kNoTimeout) {
            // Within `timeout` or not at all, as gloo's works: the request is tested until then
            // (backing off to a millisecond), and stays pending for a later wait when it is not
            // done; the group's own timeout still bounds every call.
            auto deadline = std::chrono::steady_clock::now() + timeout;
            auto pause = std::chrono::microseconds(10);
            int done = 0;
            while (td_request_test(req_, &done) == TD_OK && !done) {
                TORCH_CHECK(std::chrono::steady_clock::now() < deadline,
                            "tandem: ", c10d::opTypeToString(opType_), " did not complete within ",
                            timeout.count(), " ms");
                std::this_thread::sleep_for(pause);
                pause = std::min(2 * pause, std::chrono::microseconds(1000));
            }
            // Done, or a test that failed: the wait below reports its error.
        }
        if (req_ && !handed_) {
            td_request *req = req_;
            req_ = nullptr;
            td_status s = td_request_wait(req);
            settle(s, s ? td_last_error() : "");
        }
    }
    return c10d::Work::wait(timeout);
}

c10::intrusive_ptr<c10::ivalue::Future> WorkTandem::getFuture() {
    TORCH_CHECK(opType_ != c10d::OpType::SEND && opType_ != c10d::OpType::RECV,
                "tandem: a send or recv has no future; wait() on its work instead");
    std::lock_guard<std::mutex> guard(req_mutex_);
    if (future_) return future_;
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    if (!req_) {
        // Already settled: the future carries the outcome at once.
        std::lock_guard<std::mutex> state(mutex_);
        if (exception_)
            future_->setError(exception_);
        else
            future_->markCompleted(c10::IValue(outputs_));
    } else if (!handed_) {
        handed_ = true;
        pg_->hand_over(c10::intrusive_ptr<WorkTandem>::unsafe_reclaim_from_nonowning(this));
    }
    return future_;
}

void ProcessGroupTandem::hand_over(c10::intrusive_ptr<WorkTandem> work) {
    std::lock_guard<std::mutex> guard(completion_->mutex);
    if (!thread_.joinable()) {
        thread_ = std::thread([state = completion_] {
            std::unique_lock<std::mutex> lock(state->mutex);
            for (;;) {
                state->cond.wait(lock, [&] { return state->stop || !state->queue.empty(); });
                if (state->queue.empty()) return;
                c10::intrusive_ptr<WorkTandem> w = std::move(state->queue.front());
                state->queue.pop_front();
                lock.unlock();
                w->complete();
                w.reset(); // may be the last reference to the work, and through it to the group
                lock.lock();
            }
        });
    }
    completion_->queue.push_back(std::move(work));
    completion_->cond.notify_one();
}

} // namespace tandem_torch
