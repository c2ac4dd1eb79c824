// The harness itself: a test that cannot fail is a bug, so these prove that a
// failing, throwing or hanging rank fails the run, in bounded time.
#include "harness.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "core/clock.h"

namespace {

using mctest::Rank;

TEST(Harness, EveryRankRunsInItsOwnProcessAndSharesTheStore) {
  mctest::run_ranks(3, [](Rank& r) {
    r.store.set("pid/" + std::to_string(r.rank), std::to_string(::getpid()));
    mctest::store_barrier(r.store, "pids", r.rank, r.size);
    for (int peer = 0; peer < r.size; ++peer) {
      std::string pid = r.store.get("pid/" + std::to_string(peer), 1000);
      EXPECT_EQ(pid == std::to_string(::getpid()), peer == r.rank);
    }
    EXPECT_EQ(r.size, 3);
  });
}

TEST(Harness, AFailedExpectationInARankFailsTheRun) {
  EXPECT_NONFATAL_FAILURE(
      mctest::run_ranks(3, [](Rank& r) { EXPECT_NE(r.rank, 1) << "marker-from-rank-1"; }),
      "marker-from-rank-1");
}

TEST(Harness, AnExceptionInARankFailsTheRunWithItsMessage) {
  EXPECT_NONFATAL_FAILURE(mctest::run_ranks(2,
                                            [](Rank& r) {
                                              if (r.rank == 0)
                                                throw std::runtime_error("boom-in-rank-0");
                                            }),
                          "boom-in-rank-0");
}

TEST(Harness, AHungRankIsKilledAtTheTimeLimit) {
  const int64_t start = mooncake::now_us();
  EXPECT_NONFATAL_FAILURE(
      mctest::run_ranks(2,
                        [](Rank& r) {
                          if (r.rank == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
                        },
                        {.timeout_ms = 300, .grace_ms = 300}),
      "rank 1 of 2 was killed: still running at the time limit");
  EXPECT_LT(mooncake::now_us() - start, 5'000'000);
}

TEST(Harness, AFailedRankCutsTheRunShortAfterTheGracePeriod) {
  const int64_t start = mooncake::now_us();
  EXPECT_NONFATAL_FAILURE(mctest::run_ranks(2,
                                            [](Rank& r) {
                                              if (r.rank == 0) throw std::runtime_error("early");
                                              std::this_thread::sleep_for(std::chrono::seconds(60));
                                            },
                                            {.timeout_ms = 60000, .grace_ms = 200}),
                          "early");
  EXPECT_LT(mooncake::now_us() - start, 5'000'000);
}

TEST(Harness, ARankFailedOnTheSpotReportsItsMessage) {
  EXPECT_NONFATAL_FAILURE(mctest::run_ranks(2,
                                            [](Rank& r) {
                                              if (r.rank == 1)
                                                mctest::fail_rank_now("stuck-rank-1");
                                            }),
                          "stuck-rank-1");
}

TEST(Harness, ARankThatExitsAbruptlyStillPasses) {
  mctest::run_ranks(2, [](Rank& r) {
    if (r.rank == 1) mctest::exit_rank_abruptly();
  });
}

}  // namespace
