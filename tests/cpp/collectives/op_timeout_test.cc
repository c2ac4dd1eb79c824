// An op that a peer never calls fails with a timeout error naming that peer,
// no earlier than the op's timeout and not much later.
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

constexpr int64_t kTimeoutMs = 300;
constexpr int64_t kSlackMs = 1000;

// Runs `op` on every rank but the last, which never calls it (it stays alive
// until the others are done). Each caller must time out, blaming the last rank.
void expect_timeout_blaming_the_absent_rank(Communicator& comm, Rank& r,
                                            const std::function<void()>& op) {
  const int absent = r.size - 1;
  if (r.rank == absent) {
    store_barrier(r.store, "callers done", r.rank, r.size, 10000);
    return;
  }
  const int64_t start = mooncake::now_us();
  try {
    op();
    ADD_FAILURE() << "the op completed without rank " << absent;
  } catch (const mooncake::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
    EXPECT_EQ(e.peer(), absent) << e.what();
  }
  const int64_t elapsed_ms = (mooncake::now_us() - start) / 1000;
  EXPECT_GE(elapsed_ms, kTimeoutMs);
  EXPECT_LT(elapsed_ms, kTimeoutMs + kSlackMs);
  store_barrier(r.store, "callers done", r.rank, r.size, 10000);
}

// With recovery off (MOONCAKE_RECOVER=0), failures surface as errors.
class OpTimeout : public GroupTest {};

TEST_P(OpTimeout, AllReduceWithAPerOpTimeout) {
  run(fail_fast(), [](Communicator& comm, Rank& r) {
    std::vector<float> data(1001, 1.0f);
    expect_timeout_blaming_the_absent_rank(comm, r, [&] {
      comm.all_reduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum, kTimeoutMs);
    });
  });
}

TEST_P(OpTimeout, BarrierWithTheGroupsDefaultTimeout) {
  GroupOptions o = fail_fast();
  o.op_timeout_ms = kTimeoutMs;
  run(o, [](Communicator& comm, Rank& r) {
    expect_timeout_blaming_the_absent_rank(comm, r, [&] { comm.barrier(); });
  });
}

TEST_P(OpTimeout, BroadcastFromAnAbsentRoot) {
  run(fail_fast(), [](Communicator& comm, Rank& r) {
    std::vector<uint8_t> data(5000);
    expect_timeout_blaming_the_absent_rank(comm, r, [&] {
      comm.broadcast(data.data(), data.size(), DType::kUInt8, r.size - 1, kTimeoutMs);
    });
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, OpTimeout,
                         testing::Values(GroupParam{2, false}, GroupParam{3, false},
                                         GroupParam{2, true}),
                         group_param_name);

}  // namespace
}  // namespace mctest
