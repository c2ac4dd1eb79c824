// The rendezvous key-value store the library talks to. The torch layer adapts
// c10d::Store (TCPStore, PrefixStore, ...) to it; C++ tests use FileStore.
// Every blocking call takes a timeout.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>

namespace mooncake {

// Requests of an implementation that can lose its store (one over the
// network) are bounded in time; one that gets no answer throws a kTimeout
// Error whose message starts with this, so that callers can tell a store out
// of reach from a key that did not appear.
inline constexpr std::string_view kStoreUnreachable = "store: out of reach";

inline bool store_unreachable(const std::exception& e) {
  return std::string_view(e.what()).starts_with(kStoreUnreachable);
}

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits up to timeout_ms for `key` to exist; throws a timeout Error.
  virtual std::string get(const std::string& key, int64_t timeout_ms) = 0;
  // Atomically adds `delta` to the integer under `key` (0 if missing).
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual bool check(const std::string& key) = 0;
  // Atomically: if `key` is missing, sets it to `desired`. Returns the value
  // the key holds afterwards (the winner's, when several ranks race).
  virtual std::string compare_set(const std::string& key, const std::string& desired) = 0;
};

// A store in a directory: one file per key, written atomically with rename.
// Works across processes on one host; meant for tests.
class FileStore : public Store {
 public:
  explicit FileStore(std::string dir);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, int64_t timeout_ms) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  std::string compare_set(const std::string& key, const std::string& desired) override;

 private:
  std::string path(const std::string& key) const;
  std::string dir_;
};

}  // namespace mooncake
