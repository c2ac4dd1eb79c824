// Waiting on a peer's signal with a deadline, and reporting what went wrong
// in the status words (kernels/api.h says what they mean).
#pragma once

#include <cstdint>

#include "kernels/api.h"
#include "kernels/common/ptx.cuh"

namespace mooncake::kernels {

// First error wins; the words live in host-mapped memory, so plain stores
// (a race between two reporters can only mix their details).
__device__ inline void report(int32_t* status, int code, int d0, int d1) {
  volatile int32_t* s = status;
  if (s[0] != kStatusOk) return;
  s[1] = d0;
  s[2] = d1;
  __threadfence_system();
  s[0] = code;
}

__device__ __forceinline__ uint64_t deadline_of(int64_t timeout_ns) {
  const uint64_t now = now_ns();
  return now + static_cast<uint64_t>(timeout_ns);
}

// Masks `source` (in active_ranks, and slot_mask when given) for `why`; the
// first masking records it in the silent words, and a deadline's in the status.
__device__ inline void mask_peer(const Common& c, int source, int phase, MaskReason why) {
  const bool first = atomicExch(c.active_ranks + source, 0) != 0;
  if (c.slot_mask != nullptr) atomicExch(c.slot_mask + source, 0);
  if (!first) return;
  if (why == kMaskedSilent) {
    report(c.status, kStatusSilentPeer, source, phase);
    volatile int32_t* timeouts = c.status + 3;
    *timeouts = *timeouts + 1;
  }
  if (c.silent != nullptr) {
    *reinterpret_cast<volatile int32_t*>(c.silent + source) = why;
    __threadfence_system();
  }
}

// Whether the host has seen `source` lost (Common::lost: gone, or silent past
// the hang limit; `gone_only`: gone). A read of host memory: callers in a loop
// look every few rounds.
__device__ __forceinline__ bool host_lost(const Common& c, int source, bool gone_only = false) {
  if (c.lost == nullptr) return false;
  const int word = ld_volatile(c.lost + source);
  return gone_only ? word == 1 : word != 0;
}

// Whether to stop waiting on `source` in round `round` of a wait: it is
// masked (active_ranks, or slot_mask when given), or the host says it is
// lost, or `deadline` passed; the last two mask it.
__device__ __forceinline__ bool gives_up(const Common& c, int source, uint32_t round,
                                         uint64_t deadline, int phase) {
  if (ld_volatile(c.active_ranks + source) == 0) return true;
  if (c.slot_mask != nullptr && ld_volatile(c.slot_mask + source) == 0) return true;
  // The lost word crosses the bus: every 16th round (a few microseconds).
  if ((round & 15) == 15 && host_lost(c, source)) {
    mask_peer(c, source, phase, kMaskedLost);
    return true;
  }
  if (now_ns() > deadline) {
    mask_peer(c, source, phase, kMaskedSilent);
    return true;
  }
  return false;
}

// Waits until `*signal` satisfies `ready`, or gives_up. True when the signal
// arrived.
template <typename Ready>
__device__ bool wait_for(const Common& c, const uint64_t* signal, Ready ready, uint64_t deadline,
                         int source, int phase, uint64_t* value) {
  for (uint32_t round = 0;; ++round) {
    const uint64_t v = ld_acquire_sys(signal);
    if (ready(v)) {
      *value = v;
      return true;
    }
    if (gives_up(c, source, round, deadline, phase)) return false;
    __nanosleep(100);
  }
}

}  // namespace mooncake::kernels
