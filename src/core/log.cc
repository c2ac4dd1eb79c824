#include "core/log.h"

#include <unistd.h>

#include <cstdio>

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
  std::fprintf(stderr, "[mooncake %s pid %d] %s\n", names[static_cast<int>(level)],
               static_cast<int>(getpid()), line.c_str());
}

}  // namespace mooncake
