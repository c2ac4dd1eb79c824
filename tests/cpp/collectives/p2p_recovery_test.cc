// P2P between live ranks across a recovery that a third rank's death calls:
// a rank still finishing a collective when the recovery is called completes
// it and goes on to its sends, so a rank that completed the collective
// earlier and now waits in a p2p receive for it gets its message, and both
// come to the agreement at their next collective. (Had the slow rank gone
// into the agreement instead, the agreement would have waited for the
// receiver, which cannot report while it waits outside any op, and left it
// out one op timeout later.)
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/p2p_group.h"
#include "core/clock.h"
#include "transport/segment.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::P2P;
using mooncake::Plane;
using mooncake::RedOp;

// The op timeout, and so the agreement's deadline for the waiter's report:
// the slow rank's resume, its sends and the waiter's receive all come before
// that report. With three copies of this test sharing two cores, 4 s left
// the waiter out in 2 runs of 24 (a run takes 30-50 ms otherwise), 12 s in
// none of 120. A longer one tests the same: had the slow rank gone into the
// agreement instead, the waiter would be left out one timeout later all the
// same.
constexpr int64_t kWaitMs = 12000;

// Polls `done` every millisecond; false after kWaitMs.
bool poll_until(const std::function<bool()>& done) {
  const int64_t until = mooncake::now_us() + kWaitMs * 1000;
  while (!done()) {
    if (mooncake::now_us() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Whether the main thread of process `pid` sleeps (state S in /proc).
bool sleeping(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'S';
}

int64_t sum_of_ranks(Communicator& comm) {
  int64_t v = int64_t{1} << comm.rank();
  comm.all_reduce(&v, 1, DType::kInt64, RedOp::kSum);
  return v;
}

// Ranks: 0 dies after the second all_reduce; 2 is stopped inside it after
// sending its part, and resumed once rank 1 has called the recovery (on
// finding 0 dead in the third); 3 completes the second all_reduce and then
// waits for 2's message. Over shared memory, where the parts the others send
// while 2 is stopped are in its segment before the recovery is called.
TEST(P2PAcrossRecovery, ARankFinishingACollectiveWhenARecoveryIsCalledStillSendsItsP2P) {
  GroupOptions o;
  o.op_timeout_ms = kWaitMs;
  o.hang_ms = 20000;  // a stopped rank is not taken for failed here
  run_group(4, o, [](Communicator& comm, Rank& r) {
    constexpr int kVictim = 0, kCaller = 1, kSlow = 2, kWaiter = 3;
    constexpr uint64_t kTag = 7;
    P2P p2p(comm.p2p_channels(), r.rank, r.size, kWaitMs);
    ASSERT_EQ(sum_of_ranks(comm), 0b1111);
    // The slow rank's first message of the next op, as the caller will see it arrive.
    const size_t from_slow = comm.p2p_channels().layout().ready_flag(Plane::kCollective, kSlow);
    const uint64_t before = mooncake::load_flag(comm.endpoint().base(), from_slow);
    if (r.rank == kSlow) r.store.set("slow pid", std::to_string(::getpid()));
    store_barrier(r.store, "ready", r.rank, r.size);

    if (r.rank == kCaller) {
      // The slow rank sends to the caller last; then it waits for the others' parts.
      const int pid = std::stoi(r.store.get("slow pid", 1000));
      ASSERT_TRUE(poll_until([&] {
        return mooncake::load_flag(comm.endpoint().base(), from_slow) != before && sleeping(pid);
      })) << "rank 2 did not send its part of the all_reduce";
      ASSERT_EQ(::kill(pid, SIGSTOP), 0);
      r.store.set("slow stopped", "1");
      EXPECT_EQ(sum_of_ranks(comm), 0b1111);
      // Resumed once the caller has told it of the recovery and reported.
      std::thread resume([&] {
        EXPECT_TRUE(poll_until([&] { return r.store.check("group/epoch/0/report/1"); }));
        ::kill(pid, SIGCONT);
      });
      EXPECT_EQ(sum_of_ranks(comm), 0b1110);  // finds rank 0 dead: the recovery
      resume.join();
    } else {
      // Nothing the slow rank waits for arrives before it is stopped.
      if (r.rank != kSlow) r.store.get("slow stopped", kWaitMs);
      EXPECT_EQ(sum_of_ranks(comm), 0b1111);
      if (r.rank == kVictim) exit_rank_abruptly();
      const std::vector<int32_t> want = message(kSlow, kTag, 100);
      if (r.rank == kSlow) expect_ok(p2p.send(want.data(), want.size() * 4, kWaiter, kTag), "send");
      if (r.rank == kWaiter) {
        std::vector<int32_t> got(want.size(), -1);
        expect_ok(p2p.recv(got.data(), got.size() * 4, kSlow, kTag), "recv from rank 2");
        EXPECT_EQ(got, want);
      }
      EXPECT_EQ(sum_of_ranks(comm), 0b1110) << "every survivor stays in the group";
    }
    comm.barrier();
  });
}

}  // namespace
}  // namespace mctest
