// Errors, in two kinds:
//  * typed recoverable exceptions (bad argument, timeout, peer failure, this
//    rank left out) that carry the operation, the peer and the cause; the
//    torch binding maps them to ValueError / TimeoutError / PeerFailedError /
//    LeftOutError / RuntimeError (python/mooncake/errors.py);
//  * invariant assertions (MC_ASSERT) that print the condition and throw an
//    InternalError. Library code never exits or aborts the process.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace mooncake {

enum class ErrorKind {
  kInvalidArgument,
  kTimeout,
  // An op cannot complete because of a failed peer (peer(): that rank, or -1).
  kPeerFailed,
  // The other ranks left this rank out of the group (they took it for failed);
  // peer() is this rank. Final: never retried, never a failure to recover from.
  kLeftOut,
  kUnsupported,
  kSystem,
  kInternal,
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what, int peer = -1)
      : std::runtime_error(what), kind_(kind), peer_(peer) {}
  ErrorKind kind() const { return kind_; }
  // The peer rank the error concerns, or -1.
  int peer() const { return peer_; }
  // A peer failed or a deadline passed: what recovery and masking deal with
  // (not kLeftOut: a rank left out has no group left to recover with).
  bool peer_or_timeout() const {
    return kind_ == ErrorKind::kPeerFailed || kind_ == ErrorKind::kTimeout;
  }

 private:
  ErrorKind kind_;
  int peer_;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<<.
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  return os.str();
}

template <typename... Args>
[[noreturn]] void throw_error(ErrorKind kind, int peer, const Args&... args) {
  throw Error(kind, ::mooncake::str(args...), peer);
}

}  // namespace mooncake

// Bad input from a user: names the argument and the rule it broke.
#define MC_CHECK_ARG(cond, ...)                                                          \
  do {                                                                                   \
    if (!(cond))                                                                         \
      ::mooncake::throw_error(::mooncake::ErrorKind::kInvalidArgument, -1, __VA_ARGS__); \
  } while (0)

// An invariant of the library itself.
#define MC_ASSERT(cond, ...)                                                                     \
  do {                                                                                           \
    if (!(cond))                                                                                 \
      ::mooncake::throw_error(::mooncake::ErrorKind::kInternal, -1, "internal error at ",        \
                              __FILE__, ":", __LINE__, ": ", #cond, " failed. ", ##__VA_ARGS__); \
  } while (0)

// A syscall returning -1 on failure (errno set).
#define MC_SYSCHECK(expr, ...)                                                                    \
  ([&]() {                                                                                        \
    auto mc_rv_ = (expr);                                                                         \
    if (mc_rv_ == -1) {                                                                           \
      int mc_errno_ = errno;                                                                      \
      ::mooncake::throw_error(::mooncake::ErrorKind::kSystem, -1, #expr,                          \
                              " failed: ", std::strerror(mc_errno_), " (errno ", mc_errno_, ") ", \
                              ##__VA_ARGS__);                                                     \
    }                                                                                             \
    return mc_rv_;                                                                                \
  }())
