// Liveness: a connected peer is alive, and is seen dead soon after its
// process exits (shm: through its pidfd; tcp: through its closed connection);
// a process that was stopped for a while does not take its live peers for
// silent when it resumes.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "core/clock.h"
#include "transport/endpoint_group.h"

namespace mctest {
namespace {

class Liveness : public TransportTest {};

TEST_P(Liveness, APeerIsAliveWhileItsProcessRuns) {
  run_ranks(3, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    for (int peer = 0; peer < r.size; ++peer) EXPECT_TRUE(ep->alive(peer)) << "peer " << peer;
    store_barrier(r.store, "checked", r.rank, r.size);
  });
}

TEST_P(Liveness, APeerIsSeenDeadSoonAfterItsProcessExits) {
  run_ranks(2, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    EXPECT_TRUE(ep->alive(1 - r.rank));
    store_barrier(r.store, "seen alive", r.rank, r.size);
    if (r.rank == 1) exit_rank_abruptly();  // no destructors: as after a crash
    const int64_t start = mooncake::now_us();
    while (ep->alive(1) && mooncake::now_us() - start < 3'000'000)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_FALSE(ep->alive(1)) << "rank 1 exited 3 s ago";
    EXPECT_FALSE(ep->alive(1)) << "dead peers stay dead";
    EXPECT_TRUE(ep->alive(0)) << "a rank is always alive to itself";
  });
}

// Rank 1 stops rank 0's whole process (heartbeat thread included) for 1.5 s.
// Rank 0's main thread samples silent_ms(1) all along: as soon as it runs
// again, before or after its heartbeat thread, rank 1 must not look silent
// (it was beating all the time; rank 0 is the one that stood still).
TEST_P(Liveness, AResumedProcessDoesNotTakeItsLivePeersForSilent) {
  run_ranks(2, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    if (r.rank == 1) {
      const pid_t pid = static_cast<pid_t>(std::stol(r.store.get("pid 0", 10000)));
      r.store.get("sampling", 10000);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ASSERT_EQ(::kill(pid, SIGSTOP), 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      ASSERT_EQ(::kill(pid, SIGCONT), 0);
      r.store.get("done", 20000);
      return;
    }
    // Rank 1's heartbeats reach this rank before the stop (ucx sets a
    // connection up on its first message, not at connect).
    const int64_t until = mooncake::now_us() + 10'000'000;
    while (ep->heartbeat(1) == 0 && mooncake::now_us() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_GT(ep->heartbeat(1), 0u) << "no heartbeat from rank 1 within 10 s";
    r.store.set("pid 0", std::to_string(::getpid()));
    r.store.set("sampling", "1");
    int64_t worst = 0;
    const int64_t start = mooncake::now_us();
    while (mooncake::now_us() - start < 3'000'000) worst = std::max(worst, ep->silent_ms(1));
    EXPECT_LT(worst, 500) << "rank 1 looked silent for " << worst << " ms";
    r.store.set("done", "1");
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Liveness, testing::ValuesIn(every_transport()),
                         transport_name);

}  // namespace
}  // namespace mctest
