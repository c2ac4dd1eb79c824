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

// One thread that runs submitted tasks in submission order; each task's
// outcome completes its Request.
class OpQueue {
 public:
  OpQueue() = default;
  ~OpQueue() { stop(); }
  std::shared_ptr<Request> submit(std::function<void()> task);
  // Runs queued tasks on the calling thread, in order, until `request` is
  // done or the queue's own thread is busy; then waits as Request::wait does.
  // A caller that blocks anyway does the work itself and saves two thread
  // hand-offs per op.
  bool wait(const std::shared_ptr<Request>& request, int64_t timeout_ms);
  // Fails what is still queued with `reason`, finishes the running task, joins.
  void stop(const char* reason = "the process group was shut down");

 private:
  void run();
  // Pops the head task if no one is running one; false otherwise.
  bool run_head_locked(std::unique_lock<std::mutex>& lock);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<Request>>> tasks_;
  bool stopping_ = false;
  bool running_ = false;  // a task is being run (by the thread or a waiter)
  std::thread thread_;
};

}  // namespace mooncake
