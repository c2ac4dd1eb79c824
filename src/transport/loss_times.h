// When this process's transport told of each peer's loss: for benchmarks and
// chaos runs that ask where a failure's milliseconds went (a peer's death,
// this host's news of it, the device's masking, the step's return).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

#include "transport/engine.h"

namespace mooncake {

// Times are on Clock (steady_clock: CLOCK_MONOTONIC, the clock of Python's
// time.monotonic()), in µs. A watcher is told of the peers already gone when it
// starts watching: watch early, or those times are the watch's, not the loss's.
class LossTimes : public std::enable_shared_from_this<LossTimes> {
 public:
  explicit LossTimes(int capacity);

  // For Endpoint::watch_peers; the watch ends once this object is gone.
  Endpoint::LossListener listener();
  // The last time `peer` was told gone (its process exited or its link
  // closed) or silent (past the hang limit); nullopt: never.
  std::optional<int64_t> gone_us(int peer) const;
  std::optional<int64_t> silent_us(int peer) const;
  int capacity() const { return capacity_; }

 private:
  void heard(int peer, Endpoint::PeerLoss why);

  const int capacity_;
  std::unique_ptr<std::atomic<int64_t>[]> gone_, silent_;  // 0: never
};

}  // namespace mooncake
