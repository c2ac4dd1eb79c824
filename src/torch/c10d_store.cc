#include "torch/c10d_store.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"
#include "core/thread.h"

namespace mooncake {

struct C10dStore::Worker {
  struct Job {
    std::function<void()> fn;
    bool done = false;
    std::exception_ptr error;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Job>> jobs;
  bool stop = false;
  std::string stuck;  // the request that did not return in time ("" while none)
  int64_t stuck_since_us = 0;
  bool running = false;  // whether a thread serves the queue

  // Serves the queue; ends after kIdle without a request (store requests come
  // in bursts: a group's setup, an agreement), so that a store nobody uses, or
  // one whose owner is gone, holds no thread.
  void loop() {
    static constexpr auto kIdle = std::chrono::milliseconds(200);
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      cv.wait_for(lock, kIdle, [&] { return stop || !jobs.empty(); });
      if (jobs.empty()) {
        running = false;
        return;
      }
      std::shared_ptr<Job> job = jobs.front();
      jobs.pop_front();
      lock.unlock();
      try {
        job->fn();
      } catch (...) {
        job->error = std::current_exception();
      }
      lock.lock();
      job->done = true;
      stuck.clear();
      cv.notify_all();
    }
  }
};

C10dStore::C10dStore(c10::intrusive_ptr<c10d::Store> store, int64_t request_ms)
    : store_(std::move(store)),
      request_ms_(request_ms < 0 ? env_int("MOONCAKE_STORE_TIMEOUT_MS") : request_ms),
      worker_(std::make_shared<Worker>()) {
  MC_CHECK_ARG(request_ms_ > 0, "MOONCAKE_STORE_TIMEOUT_MS must be > 0, got ", request_ms_);
}

C10dStore::~C10dStore() {
  std::lock_guard<std::mutex> lock(worker_->mu);
  worker_->stop = true;
  worker_->cv.notify_all();
}

void C10dStore::run(const char* what, const std::string& key, int64_t wait_ms,
                    std::function<void()> fn) {
  auto job = std::make_shared<Worker::Job>();
  job->fn = std::move(fn);
  Worker& w = *worker_;
  std::unique_lock<std::mutex> lock(w.mu);
  if (!w.stuck.empty())
    throw_error(ErrorKind::kTimeout, -1, kStoreUnreachable, ": ", w.stuck, " has not returned for ",
                (now_us() - w.stuck_since_us) / 1000, " ms (", what, " '", key, "' not sent)");
  w.jobs.push_back(job);
  if (!w.running) {
    // The thread holds the worker (and the store, through the jobs) while a
    // request runs, so a stuck one may outlive this object.
    w.running = true;
    std::thread([worker = worker_] {
      begin_library_thread("mc-store");
      worker->loop();
    }).detach();
  }
  w.cv.notify_all();
  const int64_t limit_ms =
      std::min<int64_t>(request_ms_ + std::max<int64_t>(wait_ms, 0), int64_t{1} << 40);
  if (!w.cv.wait_for(lock, std::chrono::milliseconds(limit_ms), [&] { return job->done; })) {
    w.stuck = str(what, " '", key, "'");
    w.stuck_since_us = now_us() - limit_ms * 1000;
    throw_error(ErrorKind::kTimeout, -1, kStoreUnreachable, ": ", what, " '", key,
                "' had no answer within ", limit_ms, " ms (MOONCAKE_STORE_TIMEOUT_MS=", request_ms_,
                ")");
  }
  if (job->error) std::rethrow_exception(job->error);
}

// Each request's lambda owns copies of its arguments and writes its result
// into shared state: after a timeout the caller is gone, and the request may
// still finish later.
void C10dStore::set(const std::string& key, const std::string& value) {
  run("set", key, 0, [store = store_, key, value] {
    store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  });
}

std::string C10dStore::get(const std::string& key, int64_t timeout_ms) {
  struct Got {
    std::string value, missing;  // missing: why the key did not appear ("" when it did)
  };
  auto got = std::make_shared<Got>();
  run("get", key, timeout_ms, [store = store_, key, timeout_ms, got] {
    try {
      store->wait({key}, std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 1)));
    } catch (const std::exception& e) {
      got->missing = e.what();
      if (got->missing.empty()) got->missing = "timeout";
      return;
    }
    auto v = store->get(key);
    got->value.assign(v.begin(), v.end());
  });
  if (!got->missing.empty())
    throw_error(ErrorKind::kTimeout, -1, "store: key '", key, "' did not appear within ",
                timeout_ms, " ms (", got->missing, ")");
  return got->value;
}

int64_t C10dStore::add(const std::string& key, int64_t delta) {
  auto out = std::make_shared<int64_t>(0);
  run("add", key, 0, [store = store_, key, delta, out] { *out = store->add(key, delta); });
  return *out;
}

bool C10dStore::check(const std::string& key) {
  auto out = std::make_shared<bool>(false);
  run("check", key, 0, [store = store_, key, out] { *out = store->check({key}); });
  return *out;
}

std::string C10dStore::compare_set(const std::string& key, const std::string& desired) {
  auto out = std::make_shared<std::string>();
  run("compare_set", key, 0, [store = store_, key, desired, out] {
    auto v = store->compareSet(key, {}, std::vector<uint8_t>(desired.begin(), desired.end()));
    out->assign(v.begin(), v.end());
  });
  return *out;
}

}  // namespace mooncake
