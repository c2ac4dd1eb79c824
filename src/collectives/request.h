// A unit of asynchronous work and the thread that runs them in order.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace mooncake {

class Request {
 public:
  // Waits up to timeout_ms (< 0: for ever); true when done.
  bool wait(int64_t timeout_ms);
  bool done() const;
  std::exception_ptr error() const;
  int source_rank() const;
  void set_source_rank(int rank);
  // Marks the request done (once; later calls are ignored) and runs callbacks.
  void complete(std::exception_ptr error = nullptr);
  // Runs `fn(error)` when done (at once, on this thread, if already done).
  void on_complete(std::function<void(std::exception_ptr)> fn);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  int source_rank_ = -1;
  std::exception_ptr error_;
  std::vector<std::function<void(std::exception_ptr)>> callbacks_;
};

// A request that completes when all of `parts` have, with the first error.
std::shared_ptr<Request> all_of(const std::vector<std::shared_ptr<Request>>& parts);

// Runs submitted tasks one at a time, in submission order, on its own thread
// or on the thread of a caller that waits for one of them.
//
// A caller that is about to block anyway (a synchronous collective) runs the
// task itself, which saves two thread hand-offs per op: on two cores shared
// by eight ranks each hand-off is a context switch. So the queue's thread
// leaves a fresh task alone for `start_delay_us`, giving the caller time to
// come and wait; a task nobody waits for (async_op=True) starts after that.
// After activity the thread polls for a while instead of sleeping, so
// submitting needs no wake-up syscall in a busy loop. A caller that says it
// will wait (run_now) leaves the thread out altogether: with eight ranks on
// two cores, the thread's polls alone were a context switch per op.
class OpQueue {
 public:
  // start_delay_us < 0: MOONCAKE_ASYNC_DELAY_US.
  explicit OpQueue(int64_t start_delay_us = -1);
  ~OpQueue() { stop(); }
  std::shared_ptr<Request> submit(std::function<void()> task);
  // Queues `task` and runs it (and the tasks before it) on this thread now,
  // without waking the queue's thread; returns its finished request. For a
  // caller that would wait for it at once.
  std::shared_ptr<Request> run_now(std::function<void()> task);
  // Waits for `request` up to timeout_ms (< 0: for ever); true when done.
  // Waiting for ever, the caller runs queued tasks itself, in order, while no
  // other thread runs one. With a deadline it cannot (a task it ran could
  // not be left at the deadline), so it has the queue's thread start the
  // tasks up to `request` at once instead.
  bool wait(const std::shared_ptr<Request>& request, int64_t timeout_ms);
  // Fails what is still queued with `reason`, lets the running task finish, joins.
  void stop(const char* reason = "the process group was shut down");

 private:
  struct Item {
    std::function<void()> task;
    std::shared_ptr<Request> request;
    int64_t submitted_us;
    bool due = false;  // a waiter wants it started now
  };
  void run();
  // Queues `task` and returns its request (already failed when stopping).
  std::shared_ptr<Request> push_locked(std::function<void()> task);
  // Runs queued tasks on this thread until `request` is done or no longer queued.
  void run_inline_locked(std::unique_lock<std::mutex>& lock,
                         const std::shared_ptr<Request>& request);
  // Pops and runs the head task if no one is running one; false otherwise.
  bool run_head_locked(std::unique_lock<std::mutex>& lock);

  const int64_t start_delay_us_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> tasks_;
  bool stopping_ = false;
  bool running_ = false;            // a task is being run (by the thread or a waiter)
  std::thread::id running_thread_;  // the thread running it
  bool completing_ = false;         // it is over, and its request's callbacks run
  bool thread_asleep_ = false;      // the thread waits without a timeout: submit must wake it
  int inline_waiters_ = 0;          // callers waiting for a running task to finish, to run theirs
  std::thread thread_;
};

}  // namespace mooncake
