// reduce over N processes: the root ends with the rank-ordered reduction of
// every rank's input, whichever rank is root, on both algorithms.
#include <gtest/gtest.h>

#include "collectives/group.h"
#include "collectives/reference.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::RedOp;

// A sample of pairs: each accumulation kind (wrapping ints, bool logic,
// rounded 16-bit floats, NaN-propagating min/max, AVG) appears once.
const std::vector<DtypeOp> kPairs = {
    {DType::kFloat32, RedOp::kSum},  {DType::kBFloat16, RedOp::kAvg},
    {DType::kInt8, RedOp::kProduct}, {DType::kUInt64, RedOp::kBxor},
    {DType::kFloat64, RedOp::kMax},  {DType::kFloat16, RedOp::kMin},
    {DType::kBool, RedOp::kSum},
};

class Reduce : public GroupTest {
 protected:
  void check_every_root(const GroupOptions& options) {
    run(options, [](Communicator& comm, Rank& r) {
      uint64_t seed = 100;
      for (int root = 0; root < r.size; ++root) {
        for (const DtypeOp& p : kPairs) {
          for (size_t count : sample_counts()) {
            ++seed;
            std::vector<std::vector<uint8_t>> inputs;
            for (int q = 0; q < r.size; ++q)
              inputs.push_back(sample_input(p.dtype, count, q, seed, /*with_nan=*/true));
            std::vector<uint8_t> data = inputs[r.rank];
            comm.reduce(data.data(), count, p.dtype, p.op, root);
            if (r.rank != root) continue;
            EXPECT_TRUE(same_elements(
                p.dtype, data,
                reference_reduce(p.dtype, p.op, const_pointers(inputs), count, r.size)))
                << mooncake::dtype_name(p.dtype) << " " << mooncake::redop_name(p.op) << " count "
                << count << " root " << root;
          }
        }
      }
    });
  }
};

TEST_P(Reduce, RootGetsTheReferenceReductionOnTheDirectPath) {
  GroupOptions o = options();
  o.small_bytes = 1 << 20;
  check_every_root(o);
}

TEST_P(Reduce, RootGetsTheReferenceReductionOnTheReduceScatterGatherPath) {
  GroupOptions o = options();
  o.small_bytes = 1;
  check_every_root(o);
}

INSTANTIATE_TEST_SUITE_P(Worlds, Reduce, testing::ValuesIn(every_world_size()), group_param_name);

}  // namespace
}  // namespace mctest
