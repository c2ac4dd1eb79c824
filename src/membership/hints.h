// Hints: what the transport's hint words (SegmentHeader::hints, written by
// peers with Endpoint::post_hint) mean to membership, so that a rank learns
// of a membership change while it waits or idles, without asking the store
// on every op. Two slots:
//
//  * recovery: "the members of epoch e are agreeing on the next view" (e + 1).
//    A rank at epoch e abandons what it does and reports. A rank at an older
//    epoch ignores it: it is still finishing the op (an admission) that
//    brings it to epoch e, and will see the hint there.
//  * left out: "the group moved to epoch e without you". Written to the
//    ranks a decision leaves out, in case they still run.
#pragma once

#include <cstdint>

#include "transport/engine.h"

namespace mooncake {

inline constexpr int kRecoveryHint = 0;
inline constexpr int kLeftOutHint = 1;
static_assert(kRecoveryHint != kLeftOutHint && kLeftOutHint < kNumHints);

// Whether the group has moved on from `epoch` without this rank.
inline bool told_left_out(const Endpoint& endpoint, uint64_t epoch) {
  return endpoint.hint(kLeftOutHint) > epoch;
}

// Whether a rank at `epoch` must stop and join (or learn the outcome of) an agreement.
inline bool agreement_called(const Endpoint& endpoint, uint64_t epoch) {
  return endpoint.hint(kRecoveryHint) == epoch + 1 || told_left_out(endpoint, epoch);
}

inline void announce_recovery(Endpoint& endpoint, int peer, uint64_t epoch) {
  endpoint.post_hint(peer, kRecoveryHint, epoch + 1);
}

inline void announce_left_out(Endpoint& endpoint, int peer, uint64_t new_epoch) {
  endpoint.post_hint(peer, kLeftOutHint, new_epoch);
}

}  // namespace mooncake
