// Deadlines. Every wait in the library is bounded by one.
#pragma once

#include <chrono>
#include <cstdint>

namespace mooncake {

using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  // A deadline `ms` milliseconds from now; ms < 0 means never.
  static Deadline after_ms(int64_t ms) {
    Deadline d;
    d.infinite_ = ms < 0;
    d.at_ = Clock::now() + std::chrono::milliseconds(ms < 0 ? 0 : ms);
    return d;
  }
  static Deadline never() { return after_ms(-1); }

  bool infinite() const { return infinite_; }
  bool expired() const { return !infinite_ && Clock::now() >= at_; }
  // Milliseconds left, clamped to [0, cap].
  int64_t remaining_ms(int64_t cap) const {
    if (infinite_) return cap;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now()).count();
    return left < 0 ? 0 : (left > cap ? cap : left);
  }
  Deadline latest(const Deadline& other) const {
    if (infinite_ || other.infinite_) return never();
    return at_ >= other.at_ ? *this : other;
  }
  Deadline earliest(const Deadline& other) const {
    if (infinite_) return other;
    if (other.infinite_) return *this;
    return at_ <= other.at_ ? *this : other;
  }

 private:
  bool infinite_ = true;
  Clock::time_point at_{};
};

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace mooncake
