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

// A refresh claim older than this is taken over: its holder's process was
// switched out mid-read (processes taking turns on a GPU), or the word holds
// garbage. Ages are unsigned: a stamp ahead of the clock counts as old.
constexpr uint64_t kLostClaimStaleNs = 1'000'000;
// A copy younger than this is not read again: the host's news waits at most
// this long (plus the reads queued before it), against the milliseconds the
// host takes to notice, and the reader (its block stalls on the read) is not
// one of a buffer's waiting threads all the time.
constexpr uint64_t kLostRefreshNs = 20'000;
// A copy older than this is not trusted (a silent peer that came back, whose
// word the host cleared, must not stay masked by it): it waits for a refresh.
constexpr uint64_t kLostTrustNs = 1'000'000;

// FUTEX_OWNER_DIED (linux/futex.h): the bit the Linux kernel sets in a life
// word when the thread that held it dies (Common::life).
constexpr int32_t kLifeOwnerDied = 0x40000000;
// A wait shorter than this does not read its peer's life page: the page costs
// two more reads of host memory (its address, then its word), which a healthy
// step's waits, microseconds long, should not pay; a death is then seen this
// much later, against the milliseconds the host takes.
constexpr uint64_t kLifeAfterNs = 50'000;

// The copy's word for a rank the host says nothing of and whose life word was
// read too (alive, or no page): beside the host's 0 (clear), 1 (gone) and 2
// (silent), so that a long wait can tell a copy that looked at the life page
// from one a short wait made without.
constexpr uint64_t kClearLifeRead = 3;

// Reads `source`'s host word into Common::lost_seen (and, in a wait that began
// at `since` and has lasted kLifeAfterNs, its life word: dead counts as gone),
// unless another thread with the same words (a buffer's) has a read out: one
// at a time, as the GPU serves them one at a time anyway (Common::lost_seen).
__device__ inline void refresh_lost(const Common& c, int source, uint64_t since) {
  auto* claim = reinterpret_cast<unsigned long long*>(c.lost_claim);
  const uint64_t last = *reinterpret_cast<volatile uint64_t*>(c.lost_claim);
  const uint64_t now = now_ns();
  if ((last & 1) != 0 && now - (last >> 1) < kLostClaimStaleNs) return;
  const uint64_t mine = (now << 1) | 1;
  if (atomicCAS(claim, last, mine) != last) return;
  uint64_t word = static_cast<uint64_t>(ld_volatile(c.lost + source) & 3);
  if (word == 0 && c.life != nullptr && now - since > kLifeAfterNs) {
    // Its process's life word, where there is one: dead is gone.
    const uint64_t at = *reinterpret_cast<const volatile uint64_t*>(c.life + source);
    const bool dead =
        at != 0 && (ld_volatile(reinterpret_cast<const int32_t*>(at)) & kLifeOwnerDied) != 0;
    word = dead ? 1 : kClearLifeRead;  // 1: LostWords::kGone
  }
  *reinterpret_cast<volatile uint64_t*>(c.lost_seen + source) = (now << 2) | word;
  __threadfence();
  atomicCAS(claim, mine, static_cast<unsigned long long>(now_ns() << 1));  // unless taken over
}

// Whether the host has seen `source` lost (Common::lost: gone, or silent past
// the hang limit), as read at or after `since` (ns): a word read earlier may
// belong to the process that held the rank before (the host clears it for a
// new one before the launches that wait on it), so it does not count. The copy
// is read again once it is kLostRefreshNs old, so news that comes during a
// wait reaches it; and at once by a wait past kLifeAfterNs that finds a copy
// made without the life word (a shorter wait's). False until a read answers.
__device__ __forceinline__ bool host_lost(const Common& c, int source, uint64_t since) {
  if (c.lost == nullptr) return false;
  const auto* seen = reinterpret_cast<const volatile uint64_t*>(c.lost_seen + source);
  uint64_t e = *seen;
  const uint64_t now = now_ns();
  const bool life_due = (e & 3) == 0 && c.life != nullptr && now - since > kLifeAfterNs;
  if (now - (e >> 2) > kLostRefreshNs || life_due) {
    refresh_lost(c, source, since);
    e = *seen;
  }
  if ((e >> 2) < since || now_ns() - (e >> 2) > kLostTrustNs) return false;
  return (e & 3) == 1 || (e & 3) == 2;  // gone or silent (not kClearLifeRead)
}

// Whether to stop waiting on `source` in round `round` of a wait: it is
// masked (active_ranks, or slot_mask when given), or the host says it is
// lost, or `deadline` passed; the last two mask it. `deadline` is
// deadline_of(c.timeout_ns) taken during the launch (at the wait's start or
// the source's last sign of life), so the host's word counts as read after
// deadline - timeout_ns.
__device__ __forceinline__ bool gives_up(const Common& c, int source, uint32_t round,
                                         uint64_t deadline, int phase) {
  if (ld_volatile(c.active_ranks + source) == 0) return true;
  if (c.slot_mask != nullptr && ld_volatile(c.slot_mask + source) == 0) return true;
  // Every 4th round (a read of the words' device copy).
  if ((round & 3) == 3 && host_lost(c, source, deadline - static_cast<uint64_t>(c.timeout_ns))) {
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
