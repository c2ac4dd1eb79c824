// The knobs of a communication plane (the collectives' Communicator and the
// elastic EP peers), as given by the caller or, where left unset, by the
// environment (core/env.h). Kept down here so that each plane reads the
// environment the same way without depending on the other.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake {

struct CommConfig {
  int64_t timeout_ms = 30000;  // default deadline of one op; < 0: none
  size_t chunk_bytes = 0;      // 0: MOONCAKE_CHUNK_BYTES
  size_t small_bytes = 0;      // 0: MOONCAKE_SMALL_MSG_BYTES
  int recover = -1;            // 1: survivors re-run failed ops; 0: ops fail; < 0: MOONCAKE_RECOVER
  int64_t hang_ms = -1;        // silence that counts as a failure; 0: never; < 0: MOONCAKE_HANG_MS
  // Every field from the environment (MOONCAKE_PG_TIMEOUT_MS when > 0, else
  // `timeout_ms`). Throws kInvalidArgument naming the variable when one is
  // out of range.
  static CommConfig from_env(int64_t timeout_ms);
};

}  // namespace mooncake
