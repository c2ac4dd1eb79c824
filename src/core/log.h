// Minimal leveled logging to stderr, controlled by MOONCAKE_LOG_LEVEL.
#pragma once

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
