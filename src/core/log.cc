#include "core/log.h"

#include <unistd.h>

#include <cstdio>
#include <ctime>

#include "core/env.h"

namespace mooncake {

LogLevel log_level() {
  static const LogLevel level = [] {
    std::string s = env_string("MOONCAKE_LOG_LEVEL");
    if (s == "error") return LogLevel::kError;
    if (s == "info") return LogLevel::kInfo;
    if (s == "debug") return LogLevel::kDebug;
    return LogLevel::kWarn;
  }();
  return level;
}

void log_line(LogLevel level, const std::string& line) {
  static const char* names[] = {"E", "W", "I", "D"};
  // Wall-clock seconds, so that lines of several processes (and a test's own
  // time.time() stamps) line up.
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  std::fprintf(stderr, "[mooncake %s pid %d %ld.%06ld] %s\n", names[static_cast<int>(level)],
               static_cast<int>(getpid()), static_cast<long>(ts.tv_sec),
               static_cast<long>(ts.tv_nsec / 1000), line.c_str());
}

}  // namespace mooncake
