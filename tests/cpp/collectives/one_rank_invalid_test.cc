// Calls where only one rank's arguments are invalid on their own (its
// all_to_all self split disagrees with itself, its root is out of range, its
// op is undefined for the dtype) are mismatched calls too: the op must fail
// with an invalid-argument error on every rank, not only on the rank that
// noticed, and leave the group usable. The others must not be left to time out.
#include <gtest/gtest.h>

#include <functional>

#include "collectives/group.h"
#include "collectives/rejection.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::RedOp;

class OneRankInvalid : public GroupTest {
 protected:
  GroupOptions options() const {
    GroupOptions o = GroupTest::options();
    o.op_timeout_ms = 1000;  // what the other ranks wait if the error is not shared
    o.limits.timeout_ms = 15000;
    return o;
  }
};

TEST_P(OneRankInvalid, AllToAllSelfSplitThatDisagreesWithItself) {
  run(options(), [](Communicator& comm, Rank& r) {
    std::vector<size_t> in_counts(r.size, 4), out_counts(r.size, 4);
    if (r.rank == 0) out_counts[0] = 5;  // sends itself 4, expects 5 from itself
    std::vector<std::vector<float>> ins(r.size, std::vector<float>(5)), outs = ins;
    expect_rejected_then_usable(
        comm, r,
        [&] {
          comm.all_to_all(const_pointers(ins).data(), in_counts.data(), pointers(outs).data(),
                          out_counts.data(), DType::kFloat32);
        },
        "all_to_all whose self split disagrees on rank 0");
  });
}

TEST_P(OneRankInvalid, BroadcastRootOutOfRangeOnOneRank) {
  run(options(), [](Communicator& comm, Rank& r) {
    std::vector<float> data(8, 1.0f);
    const int root = r.rank == 0 ? r.size : 0;
    expect_rejected_then_usable(
        comm, r, [&] { comm.broadcast(data.data(), data.size(), DType::kFloat32, root); },
        "broadcast with an out-of-range root on rank 0");
  });
}

TEST_P(OneRankInvalid, AllReduceOpUndefinedForTheDtypeOnOneRank) {
  run(options(), [](Communicator& comm, Rank& r) {
    std::vector<int32_t> data(8, 1);
    const RedOp op = r.rank == 0 ? RedOp::kAvg : RedOp::kSum;  // AVG is undefined on int32
    expect_rejected_then_usable(
        comm, r, [&] { comm.all_reduce(data.data(), data.size(), DType::kInt32, op); },
        "all_reduce with AVG on int32 on rank 0, SUM elsewhere");
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, OneRankInvalid,
                         testing::Values(GroupParam{2, false}, GroupParam{3, true}),
                         group_param_name);

}  // namespace
}  // namespace mctest
