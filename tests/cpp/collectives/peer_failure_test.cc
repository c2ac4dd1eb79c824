// An op whose peer process has exited fails on every surviving rank with a
// peer-failed error naming that peer, promptly (from the liveness probe), not
// at the op's timeout.
#include <gtest/gtest.h>

#include "collectives/group.h"
#include "core/clock.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::ErrorKind;
using mooncake::RedOp;

// With recovery off (MOONCAKE_RECOVER=0), failures surface as errors.
class PeerFailure : public GroupTest {};

TEST_P(PeerFailure, AllReduceFailsPromptlyWhenAPeerProcessHasExited) {
  GroupOptions o = fail_fast();
  o.op_timeout_ms = 20000;
  run(o, [](Communicator& comm, Rank& r) {
    const int dead = r.size - 1;
    if (r.rank == dead) exit_rank_abruptly();
    const int64_t start = mooncake::now_us();
    std::vector<float> data(1001, 1.0f);
    try {
      comm.all_reduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum);
      ADD_FAILURE() << "all_reduce completed without rank " << dead;
    } catch (const mooncake::Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kPeerFailed) << e.what();
      EXPECT_EQ(e.peer(), dead) << e.what();
    }
    EXPECT_LT(mooncake::now_us() - start, 3'000'000) << "far sooner than the 20 s timeout";
    // The survivors stay until all of them have failed: a survivor that left
    // early would be a second failure for the others to see.
    store_barrier(r.store, "survivors failed", r.rank, r.size - 1, 30000);
  });
}

// Over tcp with three or more ranks, a survivor may see the failure first
// (its send to the dead rank fails) and abandon the op before sending to
// another survivor, which then waits for it; so the test above runs on the
// groups where each survivor finds the failure on its own, and this one
// isolates the other case.
class PeerFailureWhileWaitingOnALiveRank : public PeerFailure {};

TEST_P(PeerFailureWhileWaitingOnALiveRank, TheOpStillFailsPromptly) {
  // Rank 0 waits for rank 1, which is alive but has not called the op (as
  // when it abandoned the op on seeing the failure first), while the last
  // rank has exited: the op can never complete, and rank 0 can know it.
  GroupOptions o = fail_fast();
  o.op_timeout_ms = 3000;
  run(o, [](Communicator& comm, Rank& r) {
    const int dead = r.size - 1;
    if (r.rank == dead) exit_rank_abruptly();
    if (r.rank == 0) {
      const int64_t start = mooncake::now_us();
      std::vector<float> data(33, 1.0f);
      try {
        comm.all_reduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum);
        ADD_FAILURE() << "all_reduce completed without rank " << dead;
      } catch (const mooncake::Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kPeerFailed) << e.what();
        EXPECT_EQ(e.peer(), dead) << e.what();
      }
      EXPECT_LT(mooncake::now_us() - start, 2'000'000) << "rank " << dead << " exited long before";
    }
    store_barrier(r.store, "rank 0 done", r.rank, r.size - 1, 30000);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, PeerFailure,
                         testing::Values(GroupParam{2, false}, GroupParam{3, false},
                                         GroupParam{7, false}, GroupParam{2, true}),
                         group_param_name);

INSTANTIATE_TEST_SUITE_P(Worlds, PeerFailureWhileWaitingOnALiveRank,
                         testing::Values(GroupParam{3, false}, GroupParam{3, true}),
                         group_param_name);

}  // namespace
}  // namespace mctest
