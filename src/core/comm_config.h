// The knobs of a communication plane (the collectives' Communicator and the
// elastic EP peers), as given by the caller or, where left unset, by the
// environment (core/env.h). Kept down here so that each plane reads the
// environment the same way without depending on the other.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake {

// What an op does when it meets a failed peer (CommConfig::recover).
// The survivors agree on the next view and re-run the op (MOONCAKE_RECOVER=1).
inline constexpr int kRecoverRerun = 1;
// The op fails; the failed peer stays in the view until the application
// reconciles (sync_after_failure, deactivate_ranks), and ops fail at once
// until then (MOONCAKE_RECOVER=0, auto_deactivate_on_failure=False).
inline constexpr int kRecoverOff = 0;
// The op fails; the next op (or sync_after_failure) first has the survivors
// agree on a view without the failed peer (auto_sync_on_failure=False).
inline constexpr int kRecoverDeferred = 2;

struct CommConfig {
  int64_t timeout_ms = 30000;  // default deadline of one op; < 0: none
  size_t chunk_bytes = 0;      // 0: MOONCAKE_CHUNK_BYTES
  size_t small_bytes = 0;      // 0: MOONCAKE_SMALL_MSG_BYTES
  int recover = -1;            // kRecover*; < 0: MOONCAKE_RECOVER (1 or 0)
  int64_t hang_ms = -1;        // silence that counts as a failure; 0: never; < 0: MOONCAKE_HANG_MS
  // How long members have to answer a recovery's announcement once the op's
  // own deadline has passed (capped by the op's timeout); pg's
  // set_fault_reconciliation_window_us.
  int64_t report_grace_ms = 500;
  // Every field from the environment (MOONCAKE_PG_TIMEOUT_MS when > 0, else
  // `timeout_ms`). Throws kInvalidArgument naming the variable when one is
  // out of range.
  static CommConfig from_env(int64_t timeout_ms);
};

}  // namespace mooncake
