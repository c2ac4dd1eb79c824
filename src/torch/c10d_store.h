// Adapts a torch c10d::Store (TCPStore, PrefixStore, ...) to the library's
// Store interface (store/store.h).
#pragma once

#include <algorithm>
#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "core/error.h"
#include "store/store.h"

namespace mooncake {

class C10dStore : public Store {
 public:
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key, int64_t timeout_ms) override {
    try {
      store_->wait({key}, std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 1)));
    } catch (const std::exception& e) {
      throw_error(ErrorKind::kTimeout, -1, "store: key '", key, "' did not appear within ",
                  timeout_ms, " ms (", e.what(), ")");
    }
    auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  bool check(const std::string& key) override { return store_->check({key}); }
  std::string compare_set(const std::string& key, const std::string& desired) override {
    auto v = store_->compareSet(key, {}, std::vector<uint8_t>(desired.begin(), desired.end()));
    return std::string(v.begin(), v.end());
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace mooncake
