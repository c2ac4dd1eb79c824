#include "core/error.h"

namespace mooncake {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kPeerFailed: return "peer failed";
    case ErrorKind::kLeftOut: return "left out";
    case ErrorKind::kUnsupported: return "unsupported";
    case ErrorKind::kSystem: return "system error";
    case ErrorKind::kInternal: return "internal error";
  }
  return "error";
}

}  // namespace mooncake
