// Calls that disagree across ranks (sizes, dtypes, ops, roots, op types,
// split sizes) raise an invalid-argument error on every rank, and the group
// stays usable: the next op runs normally.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "collectives/group.h"
#include "collectives/rejection.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::RedOp;

class Mismatch : public GroupTest {
 protected:
  GroupOptions options() const {
    GroupOptions o = GroupTest::options();
    o.op_timeout_ms = 5000;  // a missed detection shows up as a timeout, not a hang
    return o;
  }
};

TEST_P(Mismatch, AllReduceElementCountsDiffer) {
  run(options(), [](Communicator& comm, Rank& r) {
    const bool odd_one = r.rank == r.size - 1;
    // Both small, both large (many chunks), and one small (direct) against
    // one large (two-phase).
    for (auto [usual, other] : {std::pair<size_t, size_t>{33, 34}, {1001, 2002}, {60, 1001}}) {
      std::vector<float> data(std::max(usual, other), 1.0f);
      expect_rejected_then_usable(
          comm, r,
          [&] {
            comm.all_reduce(data.data(), odd_one ? other : usual, DType::kFloat32, RedOp::kSum);
          },
          "all_reduce with different counts");
    }
  });
}

TEST_P(Mismatch, AllReduceDtypesDiffer) {
  run(options(), [](Communicator& comm, Rank& r) {
    for (size_t count : {size_t{33}, size_t{1001}}) {
      std::vector<int32_t> data(count, 1);  // float32 and int32 have the same size
      const DType t = r.rank == 0 ? DType::kFloat32 : DType::kInt32;
      expect_rejected_then_usable(
          comm, r, [&] { comm.all_reduce(data.data(), count, t, RedOp::kSum); },
          "all_reduce with different dtypes");
    }
  });
}

TEST_P(Mismatch, AllReduceOpsDiffer) {
  run(options(), [](Communicator& comm, Rank& r) {
    for (size_t count : {size_t{33}, size_t{1001}}) {
      std::vector<float> data(count, 1.0f);
      const RedOp op = r.rank == 0 ? RedOp::kMax : RedOp::kSum;
      expect_rejected_then_usable(
          comm, r, [&] { comm.all_reduce(data.data(), count, DType::kFloat32, op); },
          "all_reduce with different ops");
    }
  });
}

TEST_P(Mismatch, BroadcastRootsDiffer) {
  run(options(), [](Communicator& comm, Rank& r) {
    for (size_t count : {size_t{33}, size_t{1001}}) {
      std::vector<float> data(count, 1.0f);
      const int root = r.rank == 0 ? 0 : 1;
      expect_rejected_then_usable(
          comm, r, [&] { comm.broadcast(data.data(), count, DType::kFloat32, root); },
          "broadcast with different roots");
    }
  });
}

TEST_P(Mismatch, ReduceRootsDiffer) {
  run(options(), [](Communicator& comm, Rank& r) {
    std::vector<float> data(1001, 1.0f);
    const int root = r.rank == 0 ? 0 : 1;
    expect_rejected_then_usable(
        comm, r, [&] { comm.reduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum, root); },
        "reduce with different roots");
  });
}

TEST_P(Mismatch, GatherRootsDiffer) {
  run(options(), [](Communicator& comm, Rank& r) {
    std::vector<float> in(40, 1.0f);
    std::vector<std::vector<float>> outs(r.size, std::vector<float>(40));
    const int root = r.rank == 0 ? 0 : 1;
    expect_rejected_then_usable(
        comm, r,
        [&] { comm.gather(in.data(), in.size(), DType::kFloat32, pointers(outs).data(), root); },
        "gather with different roots");
  });
}

TEST_P(Mismatch, ScatterCountsDiffer) {
  run(options(), [](Communicator& comm, Rank& r) {
    std::vector<std::vector<float>> ins(r.size, std::vector<float>(500, 1.0f));
    std::vector<float> out(500);
    const size_t count = r.rank == 1 ? 499 : 500;
    expect_rejected_then_usable(
        comm, r,
        [&] { comm.scatter(const_pointers(ins).data(), out.data(), count, DType::kFloat32, 0); },
        "scatter with different counts");
  });
}

TEST_P(Mismatch, DifferentOpsCalledAtTheSameTime) {
  run(options(), [](Communicator& comm, Rank& r) {
    std::vector<float> data(33, 1.0f);
    std::vector<std::vector<float>> outs(r.size, std::vector<float>(33));
    expect_rejected_then_usable(
        comm, r,
        [&] {
          if (r.rank == 0)
            comm.all_gather(data.data(), data.size(), DType::kFloat32, pointers(outs).data());
          else
            comm.all_reduce(data.data(), data.size(), DType::kFloat32, RedOp::kSum);
        },
        "all_gather on rank 0, all_reduce elsewhere");
  });
}

TEST_P(Mismatch, AllToAllSplitsDisagreeOnOneEdgeOnly) {
  run(options(), [](Communicator& comm, Rank& r) {
    // Every edge carries 300 floats (several chunks) except that rank 1
    // expects 299 from rank 0: only ranks 0 and 1 can see it from their data.
    std::vector<size_t> in_counts(r.size, 300), out_counts(r.size, 300);
    if (r.rank == 1) out_counts[0] = 299;
    std::vector<std::vector<float>> ins(r.size, std::vector<float>(300, 1.0f));
    std::vector<std::vector<float>> outs(r.size, std::vector<float>(300));
    expect_rejected_then_usable(
        comm, r,
        [&] {
          comm.all_to_all(const_pointers(ins).data(), in_counts.data(), pointers(outs).data(),
                          out_counts.data(), DType::kFloat32);
        },
        "all_to_all with one disagreeing edge");
  });
}

TEST_P(Mismatch, ManyMismatchesInARowLeaveTheGroupInStep) {
  run(options(), [](Communicator& comm, Rank& r) {
    std::vector<double> data(200, 1.0);
    for (int i = 0; i < 10; ++i)
      expect_rejected_then_usable(
          comm, r,
          [&] {
            comm.all_reduce(data.data(), r.rank == i % r.size ? 100 : 200, DType::kFloat64,
                            RedOp::kSum);
          },
          "repeated all_reduce with different counts");
  });
}

// Every world size above one: a mismatch needs two ranks.
std::vector<GroupParam> groups_of_two_or_more() {
  return {{2, false}, {3, false}, {7, false}, {3, true}};
}

INSTANTIATE_TEST_SUITE_P(Worlds, Mismatch, testing::ValuesIn(groups_of_two_or_more()),
                         group_param_name);

}  // namespace
}  // namespace mctest
