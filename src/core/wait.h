// Bounded waiting: spin briefly, then block on a futex "doorbell" that lives in
// (possibly shared) memory. Signallers bump the doorbell and wake sleepers only
// when there are any, so a busy receiver costs the sender no syscall; of many
// signallers of one sleeper, only the first pays for the wake-up.
//
// Eight ranks share two cores in our tests: a waiter that spins for long
// starves the peer it waits for, so the spin is tens of microseconds.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "core/clock.h"

namespace mooncake {

// `seq` counts rings in its low 31 bits; the top bit says a waiter sleeps (or
// is about to). A ring bumps the count and clears the bit in one step, and
// only the ring that cleared it makes the wake-up call: with eight ranks on
// two cores a sleeper is often woken but not yet running when its other
// peers ring, and a wake-up per ring cost most ranks a syscall per message.
struct Doorbell {
  std::atomic<uint32_t> seq{0};
  uint32_t unused = 0;  // keeps the segment header's layout
};
static_assert(sizeof(Doorbell) == 8);

// Wakes every waiter of `bell` (process-shared futex).
void ring(Doorbell* bell);

// Spin budget: MOONCAKE_SPIN_US when it is set; otherwise its default, or 0
// once note_ranks_on_host() has counted more ranks on this host than CPUs
// this process may run on (a spinning waiter then takes the CPU that the
// peer it waits for needs).
int64_t spin_budget_us();
// Called by each group with how many of its ranks run on this host.
void note_ranks_on_host(int ranks);

// Waits until `ready()` is true or `deadline` passes (returns false then).
// While blocked it wakes at least every `poll_ms` and calls `poll()`, which
// may throw (e.g. a peer process has died) or return true to stop waiting.
bool wait_on(Doorbell* bell, const std::function<bool()>& ready, const Deadline& deadline,
             const std::function<bool()>& poll = nullptr, int64_t poll_ms = 50);

}  // namespace mooncake
