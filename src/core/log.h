// Minimal leveled logging to stderr, controlled by MOONCAKE_LOG_LEVEL.
#pragma once

#include <cstdint>

#include "core/clock.h"
#include "core/error.h"

namespace mooncake {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

LogLevel log_level();
void log_line(LogLevel level, const std::string& line);

}  // namespace mooncake

#define MC_LOG(level, ...)                                                             \
  do {                                                                                 \
    if (static_cast<int>(::mooncake::LogLevel::level) <=                               \
        static_cast<int>(::mooncake::log_level()))                                     \
      ::mooncake::log_line(::mooncake::LogLevel::level, ::mooncake::str(__VA_ARGS__)); \
  } while (0)

namespace mooncake {

// How many lines of warnings about bad input a transport logs a second.
constexpr int kWarningsPerSecond = 10;

// At most `per_second` warnings a second from one source, so that a flood of
// bad input cannot flood stderr; the first line of the next second says how
// many were left out. Not thread-safe: its owner serializes the calls.
class LogLimiter {
 public:
  explicit LogLimiter(int per_second) : per_second_(per_second) {}

  // Whether to log one more line now. `what` names the lines in the summary.
  bool allow(const char* what) {
    const int64_t now = now_us();
    if (now - window_us_ >= 1000000) {
      if (suppressed_ > 0) MC_LOG(kWarn, suppressed_, " more ", what, " in the last second");
      window_us_ = now;
      logged_ = 0;
      suppressed_ = 0;
    }
    if (logged_ < per_second_) {
      ++logged_;
      return true;
    }
    ++suppressed_;
    return false;
  }

 private:
  const int per_second_;
  int64_t window_us_ = 0;
  int logged_ = 0;
  uint64_t suppressed_ = 0;
};

}  // namespace mooncake
