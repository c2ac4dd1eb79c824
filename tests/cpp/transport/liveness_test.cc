// Liveness: a connected peer is alive, and is seen dead soon after its
// process exits (shm: through its pidfd; tcp: through its closed connection).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/clock.h"
#include "transport/endpoint_group.h"

namespace mctest {
namespace {

class Liveness : public TransportTest {};

TEST_P(Liveness, APeerIsAliveWhileItsProcessRuns) {
  run_ranks(3, [this](Rank& r) {
    auto ep = connect_endpoint(r, tcp(), 4096);
    for (int peer = 0; peer < r.size; ++peer) EXPECT_TRUE(ep->alive(peer)) << "peer " << peer;
    store_barrier(r.store, "checked", r.rank, r.size);
  });
}

TEST_P(Liveness, APeerIsSeenDeadSoonAfterItsProcessExits) {
  run_ranks(2, [this](Rank& r) {
    auto ep = connect_endpoint(r, tcp(), 4096);
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

INSTANTIATE_TEST_SUITE_P(Transports, Liveness, testing::Bool(), transport_name);

}  // namespace
}  // namespace mctest
