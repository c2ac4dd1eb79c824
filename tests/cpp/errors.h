// Checking the library's typed errors in tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <ostream>
#include <string>

#include "core/error.h"

namespace mooncake {
// gtest prints an ErrorKind by name ("timeout"), not as bytes.
inline void PrintTo(ErrorKind kind, std::ostream* os) {
  *os << error_kind_name(kind);
}
}  // namespace mooncake

namespace mctest {

// Success when `fn` throws a mooncake::Error of `kind` whose message contains
// `contains`; otherwise says what happened instead (no error, another kind,
// another message, another exception).
testing::AssertionResult throws_error(mooncake::ErrorKind kind, const std::function<void()>& fn,
                                      const std::string& contains = "");

}  // namespace mctest
