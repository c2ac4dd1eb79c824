// Adapts a torch c10d::Store (TCPStore, PrefixStore, ...) to the library's
// Store interface (store/store.h), with every request bounded in time.
//
// A TCPStore request that waits for nothing (set, add, check, a get after the
// key exists) still blocks in a socket read until the store answers; behind a
// cut link it never does, and the read returns only when TCP gives up, many
// minutes later. So requests run on a worker thread and a caller waits at
// most `request_ms` (MOONCAKE_STORE_TIMEOUT_MS) for one: past it the request
// throws a kTimeout Error saying the store is out of reach, and later requests
// fail at once until the stuck one returns (the c10d client takes one request
// at a time anyway). A rank that cannot reach the store cannot take part in
// an agreement; the ranks that can go on without it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "store/store.h"

namespace mooncake {

class C10dStore : public Store {
 public:
  // request_ms < 0: MOONCAKE_STORE_TIMEOUT_MS.
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> store, int64_t request_ms = -1);
  ~C10dStore() override;
  C10dStore(const C10dStore&) = delete;
  C10dStore& operator=(const C10dStore&) = delete;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, int64_t timeout_ms) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  std::string compare_set(const std::string& key, const std::string& desired) override;

 private:
  struct Worker;  // the thread and its queue; outlives this object while a request is stuck
  // Runs `fn` on the worker; waits up to `wait_ms` (plus request_ms_) for it.
  // `fn` must own what it uses (it may run on after a timeout).
  void run(const char* what, const std::string& key, int64_t wait_ms, std::function<void()> fn);

  c10::intrusive_ptr<c10d::Store> store_;
  int64_t request_ms_;
  std::shared_ptr<Worker> worker_;
};

}  // namespace mooncake
