// wait_on: returns true as soon as the condition holds, false at the deadline
// (not before, not long after); a ring from another thread or process wakes a
// blocked waiter at once, without lost wake-ups; the poll callback runs while
// blocked, can end the wait, and can throw.
#include "core/wait.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "harness.h"
#include "scoped_env.h"

namespace mctest {
namespace {

using mooncake::Deadline;
using mooncake::Doorbell;
using mooncake::now_us;
using mooncake::ring;
using mooncake::wait_on;

constexpr int64_t kNoPoll = 600'000;  // a poll period longer than any test: only a ring wakes

// A doorbell and a flag in memory shared with forked children.
struct Shared {
  Doorbell bell;
  std::atomic<uint64_t> flag{0};
  Doorbell back_bell;
  std::atomic<uint64_t> back_flag{0};
};

class SharedMemory {
 public:
  SharedMemory() {
    void* p =
        ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    shared_ = new (p) Shared();
  }
  ~SharedMemory() { ::munmap(shared_, sizeof(Shared)); }
  Shared* get() { return shared_; }

 private:
  Shared* shared_;
};

TEST(WaitOn, ReturnsTrueAtOnceWhenAlreadyReady) {
  Doorbell bell;
  EXPECT_TRUE(wait_on(&bell, [] { return true; }, Deadline::after_ms(0)));
}

TEST(WaitOn, ReturnsFalseAtTheDeadlineNotBeforeAndNotLongAfter) {
  Doorbell bell;
  const int64_t start = now_us();
  EXPECT_FALSE(wait_on(&bell, [] { return false; }, Deadline::after_ms(100)));
  const int64_t elapsed_ms = (now_us() - start) / 1000;
  EXPECT_GE(elapsed_ms, 100);
  EXPECT_LT(elapsed_ms, 600);
}

TEST(WaitOn, ARingFromAnotherThreadWakesABlockedWaiterAtOnce) {
  Doorbell bell;
  std::atomic<bool> flag{false};
  std::atomic<int64_t> rung_at{0};
  std::thread ringer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the waiter is asleep by now
    flag = true;
    rung_at = now_us();
    ring(&bell);
  });
  EXPECT_TRUE(
      wait_on(&bell, [&] { return flag.load(); }, Deadline::after_ms(10000), nullptr, kNoPoll));
  const int64_t woke_after_us = now_us() - rung_at.load();
  ringer.join();
  EXPECT_LT(woke_after_us, 500'000) << "woke long after the ring";
}

TEST(WaitOn, ARingFromAnotherProcessWakesABlockedWaiterAtOnce) {
  SharedMemory mem;
  Shared* s = mem.get();
  run_ranks(2, [s](Rank& r) {
    if (r.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      s->flag = static_cast<uint64_t>(now_us());
      ring(&s->bell);
      return;
    }
    EXPECT_TRUE(wait_on(
        &s->bell, [&] { return s->flag.load() != 0; }, Deadline::after_ms(10000), nullptr,
        kNoPoll));
    EXPECT_LT(now_us() - static_cast<int64_t>(s->flag.load()), 500'000)
        << "woke long after the ring";
  });
}

TEST(WaitOn, PingPongAcrossProcessesLosesNoWakeUps) {
  // A lost wake-up would stall one round until its 5 s deadline, which the
  // time limit on the whole exchange catches.
  SharedMemory mem;
  Shared* s = mem.get();
  constexpr uint64_t kRounds = 2000;
  const int64_t start = now_us();
  run_ranks(2, [s](Rank& r) {
    ScopedEnv no_spin("MOONCAKE_SPIN_US", "0");  // block at once (unless already read here)
    for (uint64_t i = 1; i <= kRounds; ++i) {
      if (r.rank == 0) {
        s->flag = i;
        ring(&s->bell);
        ASSERT_TRUE(wait_on(
            &s->back_bell, [&] { return s->back_flag.load() >= i; }, Deadline::after_ms(5000),
            nullptr, kNoPoll))
            << "round " << i;
      } else {
        ASSERT_TRUE(wait_on(
            &s->bell, [&] { return s->flag.load() >= i; }, Deadline::after_ms(5000), nullptr,
            kNoPoll))
            << "round " << i;
        s->back_flag = i;
        ring(&s->back_bell);
      }
    }
  });
  EXPECT_LT(now_us() - start, 4'000'000) << "a round stalled: a wake-up was lost";
}

TEST(WaitOn, ManyRingersOfSeveralSleepersLoseNoWakeUps) {
  // The first ring after a waiter sleeps makes the only wake-up call; rings
  // racing with waiters going to sleep (and each other) must not lose one.
  // Each round, every ringer sets its flag and rings one bell that several
  // waiters sleep on; each waiter acks once it has seen every flag.
  constexpr int kRingers = 4, kWaiters = 3;
  constexpr uint64_t kRounds = 1500;
  Doorbell bell, ack_bell;
  std::atomic<uint64_t> flags[kRingers] = {};
  std::atomic<uint64_t> acks{0};
  std::atomic<bool> stalled{false};
  ScopedEnv no_spin("MOONCAKE_SPIN_US", "0");  // block at once (unless already read here)
  const int64_t start = now_us();
  std::vector<std::thread> threads;
  for (int w = 0; w < kWaiters; ++w)
    threads.emplace_back([&] {
      for (uint64_t i = 1; i <= kRounds && !stalled; ++i) {
        auto all_set = [&] {
          for (auto& f : flags)
            if (f.load() < i) return false;
          return true;
        };
        if (!wait_on(&bell, all_set, Deadline::after_ms(5000), nullptr, kNoPoll)) stalled = true;
        acks.fetch_add(1);
        ring(&ack_bell);
      }
    });
  for (int r = 0; r < kRingers; ++r)
    threads.emplace_back([&, r] {
      for (uint64_t i = 1; i <= kRounds && !stalled; ++i) {
        flags[r] = i;
        ring(&bell);
        if (!wait_on(
                &ack_bell, [&] { return acks.load() >= i * kWaiters; }, Deadline::after_ms(5000),
                nullptr, kNoPoll))
          stalled = true;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_FALSE(stalled.load()) << "a wait ran to its 5 s deadline: a wake-up was lost";
  EXPECT_LT(now_us() - start, 8'000'000);
}

TEST(WaitOn, AFlagSetWithoutARingIsSeenAtTheNextPoll) {
  Doorbell bell;
  std::atomic<bool> flag{false};
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    flag = true;  // no ring
  });
  const int64_t start = now_us();
  EXPECT_TRUE(wait_on(
      &bell, [&] { return flag.load(); }, Deadline::after_ms(10000), [] { return false; },
      /*poll_ms=*/30));
  setter.join();
  EXPECT_LT(now_us() - start, 1'000'000);
}

TEST(WaitOn, PollRunsWhileBlockedAndCanEndTheWait) {
  Doorbell bell;
  int polls = 0;
  const int64_t start = now_us();
  EXPECT_FALSE(wait_on(
      &bell, [] { return false; }, Deadline::after_ms(10000), [&] { return ++polls == 3; },
      /*poll_ms=*/10));
  EXPECT_EQ(polls, 3);
  const int64_t elapsed_ms = (now_us() - start) / 1000;
  EXPECT_GE(elapsed_ms, 30);
  EXPECT_LT(elapsed_ms, 1000);
}

TEST(WaitOn, AnExceptionFromPollEndsTheWait) {
  Doorbell bell;
  EXPECT_THROW(wait_on(
                   &bell, [] { return false; }, Deadline::after_ms(10000),
                   []() -> bool { throw std::runtime_error("peer died"); }, 10),
               std::runtime_error);
}

}  // namespace
}  // namespace mctest

namespace mctest {
namespace {

// Unless MOONCAKE_SPIN_US is set, waits stop spinning once a group counts
// more ranks on this host than CPUs, and stay so. In a child, so that the
// process-wide count starts at zero and nothing else sees it raised.
TEST(SpinBudget, WaitsDoNotSpinWhileRanksOutnumberTheCpus) {
  run_ranks(1, [](Rank&) {
    unsetenv("MOONCAKE_SPIN_US");
    EXPECT_EQ(mooncake::spin_budget_us(), 20);
    mooncake::note_ranks_on_host(1);
    EXPECT_EQ(mooncake::spin_budget_us(), 20);
    mooncake::note_ranks_on_host(1 << 20);
    EXPECT_EQ(mooncake::spin_budget_us(), 0);
    mooncake::note_ranks_on_host(1);  // the most any group counted stays
    EXPECT_EQ(mooncake::spin_budget_us(), 0);
  });
}

}  // namespace
}  // namespace mctest
