#include "core/wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <thread>

#include "core/env.h"

namespace mooncake {

namespace {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ms) {
  struct timespec ts;
  ts.tv_sec = timeout_ms / 1000;
  ts.tv_nsec = (timeout_ms % 1000) * 1000000;
  // Shared futex (no FUTEX_PRIVATE_FLAG): the word may be in a shared mapping.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

constexpr uint32_t kSleeping = 1u << 31;  // Doorbell::seq's waiter bit

}  // namespace

void ring(Doorbell* bell) {
  uint32_t v = bell->seq.load(std::memory_order_relaxed);
  while (!bell->seq.compare_exchange_weak(v, (v + 1) & ~kSleeping, std::memory_order_seq_cst,
                                          std::memory_order_relaxed)) {
  }
  if (v & kSleeping)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell->seq), FUTEX_WAKE, INT_MAX, nullptr,
            nullptr, 0);
}

std::atomic<int> ranks_on_host{0};  // the most any group has counted

int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int64_t spin_budget_us() {
  static const int64_t us = env_int("MOONCAKE_SPIN_US");
  // Set explicitly, the variable wins (the registry cannot tell set from default).
  static const bool given = std::getenv("MOONCAKE_SPIN_US") != nullptr;
  static const int cpus = usable_cpus();
  if (given) return us;
  return ranks_on_host.load(std::memory_order_relaxed) > cpus ? 0 : us;
}

void note_ranks_on_host(int ranks) {
  int seen = ranks_on_host.load(std::memory_order_relaxed);
  while (ranks > seen && !ranks_on_host.compare_exchange_weak(seen, ranks)) {
  }
}

bool wait_on(Doorbell* bell, const std::function<bool()>& ready, const Deadline& deadline,
             const std::function<bool()>& poll, int64_t poll_ms) {
  if (ready()) return true;
  const int64_t spin_until = now_us() + spin_budget_us();
  while (now_us() < spin_until) {
    for (int i = 0; i < 64; ++i) cpu_relax();
    if (ready()) return true;
  }
  int64_t next_poll = now_us() + poll_ms * 1000;
  for (;;) {
    uint32_t seen = bell->seq.load(std::memory_order_seq_cst);
    if (ready()) return true;
    if (deadline.expired()) return false;
    // Say so before sleeping; a ring in between changes the word, and the
    // wait then returns at once (or the set fails: look again).
    if (!(seen & kSleeping) &&
        !bell->seq.compare_exchange_strong(seen, seen | kSleeping, std::memory_order_seq_cst))
      continue;
    seen |= kSleeping;
    if (!ready()) futex_wait(&bell->seq, seen, deadline.remaining_ms(poll_ms) + 1);
    if (ready()) return true;
    if (poll && now_us() >= next_poll) {
      next_poll = now_us() + poll_ms * 1000;
      if (poll()) return ready();
    }
  }
}

}  // namespace mooncake
