#include "core/comm_config.h"

#include "core/env.h"
#include "core/error.h"

namespace mooncake {

CommConfig CommConfig::from_env(int64_t timeout_ms) {
  CommConfig c;
  int64_t env_timeout = env_int("MOONCAKE_PG_TIMEOUT_MS");
  c.timeout_ms = env_timeout > 0 ? env_timeout : timeout_ms;
  int64_t chunk = env_int("MOONCAKE_CHUNK_BYTES");
  MC_CHECK_ARG(chunk >= 64 && chunk % 64 == 0 && chunk <= (1 << 30),
               "MOONCAKE_CHUNK_BYTES must be a multiple of 64 in [64, 2^30], got ", chunk);
  c.chunk_bytes = static_cast<size_t>(chunk);
  int64_t small = env_int("MOONCAKE_SMALL_MSG_BYTES");
  MC_CHECK_ARG(small >= 0, "MOONCAKE_SMALL_MSG_BYTES must be >= 0, got ", small);
  c.small_bytes = static_cast<size_t>(small);
  int64_t recover = env_int("MOONCAKE_RECOVER");
  MC_CHECK_ARG(recover == 0 || recover == 1, "MOONCAKE_RECOVER must be 0 or 1, got ", recover);
  c.recover = static_cast<int>(recover);
  int64_t hang = env_int("MOONCAKE_HANG_MS");
  MC_CHECK_ARG(hang >= 0, "MOONCAKE_HANG_MS must be >= 0, got ", hang);
  c.hang_ms = hang;
  return c;
}

}  // namespace mooncake
