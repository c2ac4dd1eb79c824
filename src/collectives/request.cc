#include "collectives/request.h"

#include <algorithm>
#include <chrono>

#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"
#include "core/thread.h"

namespace mooncake {

bool Request::wait(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout_ms < 0) {
    cv_.wait(lock, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return done_; });
}

bool Request::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::exception_ptr Request::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

int Request::source_rank() const {
  std::lock_guard<std::mutex> lock(mu_);
  return source_rank_;
}

void Request::set_source_rank(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  source_rank_ = rank;
}

void Request::complete(std::exception_ptr error) {
  std::vector<std::function<void(std::exception_ptr)>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    error_ = error;
    callbacks.swap(callbacks_);
  }
  cv_.notify_all();
  for (auto& fn : callbacks) fn(error);
}

void Request::on_complete(std::function<void(std::exception_ptr)> fn) {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      callbacks_.push_back(std::move(fn));
      return;
    }
    error = error_;
  }
  fn(error);
}

std::shared_ptr<Request> all_of(const std::vector<std::shared_ptr<Request>>& parts) {
  auto all = std::make_shared<Request>();
  if (parts.empty()) {
    all->complete();
    return all;
  }
  struct State {
    std::mutex mu;
    size_t left;
    std::exception_ptr first_error;
  };
  auto state = std::make_shared<State>();
  state->left = parts.size();
  for (auto& part : parts)
    part->on_complete([all, state](std::exception_ptr e) {
      std::exception_ptr finished_error;
      bool last;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (e && !state->first_error) state->first_error = e;
        last = --state->left == 0;
        finished_error = state->first_error;
      }
      if (last) all->complete(finished_error);
    });
  return all;
}

namespace {
constexpr int64_t kPollUs = 200;      // the thread's poll period while active
constexpr int64_t kLingerUs = 20000;  // how long it keeps polling after activity
}  // namespace

OpQueue::OpQueue(int64_t start_delay_us)
    : start_delay_us_(start_delay_us >= 0 ? start_delay_us : env_int("MOONCAKE_ASYNC_DELAY_US")) {}

std::shared_ptr<Request> OpQueue::push_locked(std::function<void()> task) {
  auto request = std::make_shared<Request>();
  if (stopping_) {
    request->complete(
        std::make_exception_ptr(Error(ErrorKind::kPeerFailed, "the process group was shut down")));
    return request;
  }
  tasks_.push_back(Item{std::move(task), request, now_us()});
  return request;
}

std::shared_ptr<Request> OpQueue::submit(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mu_);
  auto request = push_locked(std::move(task));
  if (stopping_) return request;
  if (!thread_.joinable())
    thread_ = std::thread([this] {
      begin_library_thread("mc-ops");
      run();
    });
  else if (thread_asleep_ || (start_delay_us_ == 0 && tasks_.size() == 1 && !running_))
    // Asleep; or, with no start delay (the p2p sends' queue), between polls
    // (kPollUs): the new head is due now, not at the next poll. (A task
    // behind another starts when that one ends; with a delay, the next poll
    // is soon enough.)
    cv_.notify_all();
  return request;
}

std::shared_ptr<Request> OpQueue::run_now(std::function<void()> task) {
  std::unique_lock<std::mutex> lock(mu_);
  auto request = push_locked(std::move(task));
  run_inline_locked(lock, request);
  lock.unlock();
  request->wait(-1);  // run here, or by a thread that took it first
  return request;
}

void OpQueue::run_inline_locked(std::unique_lock<std::mutex>& lock,
                                const std::shared_ptr<Request>& request) {
  const auto self = std::this_thread::get_id();
  while (!request->done()) {
    if (run_head_locked(lock)) continue;
    if (!running_) return;  // not queued here any more (stop() failed it)
    if (completing_ && running_thread_ == self) {
      // A completion callback of this thread's own task waits for a later one
      // (a blocking op from a Work's callback): the task itself is over, so the
      // ones queued behind it run here, nested, rather than wait for this one.
      running_ = false;
      const bool ran = run_head_locked(lock);
      running_ = true;  // (still the lock's: the nested run returns holding it)
      running_thread_ = self;
      completing_ = true;
      if (!ran) return;  // nothing queued: it is not queued here any more
      continue;
    }
    // Another thread runs a task: ours (then it finishes it) or one before it
    // (then ours is next, and this thread runs it).
    ++inline_waiters_;
    cv_.wait(lock, [&] { return !running_ || request->done(); });
    --inline_waiters_;
  }
}

bool OpQueue::run_head_locked(std::unique_lock<std::mutex>& lock) {
  if (running_ || tasks_.empty()) return false;
  Item item = std::move(tasks_.front());
  tasks_.pop_front();
  running_ = true;
  running_thread_ = std::this_thread::get_id();
  completing_ = false;  // (a nested run's task: its own body runs)
  lock.unlock();
  std::exception_ptr error;
  try {
    item.task();
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  completing_ = true;
  lock.unlock();
  item.request->complete(error);
  lock.lock();
  completing_ = false;
  running_ = false;
  // Only when someone has a use for it: after every synchronous op, a wake-up
  // of an idle queue thread that finds nothing to do costs a context switch.
  if (stopping_ || inline_waiters_ > 0 || !tasks_.empty()) cv_.notify_all();
  return true;
}

void OpQueue::run() {
  std::unique_lock<std::mutex> lock(mu_);
  int64_t last_activity = now_us();
  for (;;) {
    if (stopping_ && tasks_.empty()) return;
    const int64_t now = now_us();
    if (!running_ && !tasks_.empty()) {
      const int64_t age = now - tasks_.front().submitted_us;
      if (age >= start_delay_us_ || tasks_.front().due || stopping_) {
        run_head_locked(lock);
        last_activity = now_us();
      } else {
        cv_.wait_for(lock, std::chrono::microseconds(start_delay_us_ - age));
      }
      continue;
    }
    // Lingers after its own tasks only: ops a caller runs inline (synchronous
    // ones) do not keep it polling.
    if (now - last_activity < kLingerUs) {
      cv_.wait_for(lock, std::chrono::microseconds(kPollUs));
      continue;
    }
    thread_asleep_ = true;
    // (Not while a waiter runs a task inline: the tasks behind it are that
    // waiter's, or this thread's once it ends, which wakes it.)
    cv_.wait(lock, [&] { return stopping_ || (!tasks_.empty() && !running_); });
    thread_asleep_ = false;
    last_activity = now_us();
  }
}

bool OpQueue::wait(const std::shared_ptr<Request>& request, int64_t timeout_ms) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // From a completion callback of this thread's own task: the tasks run here,
    // nested, whatever the timeout (none could start while it waits).
    if (timeout_ms < 0 || (completing_ && running_thread_ == std::this_thread::get_id())) {
      run_inline_locked(lock, request);
    } else {
      auto it = std::find_if(tasks_.begin(), tasks_.end(),
                             [&](const Item& item) { return item.request == request; });
      if (it != tasks_.end()) {  // still queued: it and all before it are due now
        for (auto at = tasks_.begin(); at != std::next(it); ++at) at->due = true;
        cv_.notify_all();
      }
    }
  }
  return request->wait(timeout_ms);
}

void OpQueue::stop(const char* reason) {
  std::deque<Item> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    dropped.swap(tasks_);
  }
  cv_.notify_all();
  for (auto& item : dropped)
    item.request->complete(std::make_exception_ptr(Error(ErrorKind::kPeerFailed, reason)));
  const auto self = std::this_thread::get_id();
  if (thread_.joinable()) {
    if (thread_.get_id() != self)
      thread_.join();
    else
      thread_.detach();  // stop() from a task's completion callback on the queue's thread
  }
  std::unique_lock<std::mutex> lock(mu_);
  // A waiter may be running a task inline; unless that is this very thread.
  cv_.wait(lock, [&] { return !running_ || running_thread_ == self; });
}

}  // namespace mooncake
