// all_gather over N processes: slice p of every rank's output is rank p's input.
#include <gtest/gtest.h>

#include "collectives/group.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;

class AllGather : public GroupTest {};

TEST_P(AllGather, SliceOfEveryRankIsThatRanksInput) {
  run([](Communicator& comm, Rank& r) {
    uint64_t seed = 300;
    for (DType t : {DType::kUInt8, DType::kFloat16, DType::kInt32, DType::kFloat64}) {
      for (size_t count : sample_counts()) {
        ++seed;
        const std::vector<uint8_t> in = sample_input(t, count, r.rank, seed);
        std::vector<std::vector<uint8_t>> outs(r.size, garbage(t, count));
        comm.all_gather(in.data(), count, t, pointers(outs).data());
        for (int p = 0; p < r.size; ++p)
          EXPECT_TRUE(same_elements(t, outs[p], sample_input(t, count, p, seed)))
              << mooncake::dtype_name(t) << " count " << count << " slice " << p;
      }
    }
  });
}

TEST_P(AllGather, OwnSliceMayAliasTheInput) {
  run([](Communicator& comm, Rank& r) {
    const size_t count = 301;
    std::vector<std::vector<uint8_t>> outs(r.size, garbage(DType::kFloat32, count));
    outs[r.rank] = sample_input(DType::kFloat32, count, r.rank, 7);
    comm.all_gather(outs[r.rank].data(), count, DType::kFloat32, pointers(outs).data());
    for (int p = 0; p < r.size; ++p)
      EXPECT_TRUE(
          same_elements(DType::kFloat32, outs[p], sample_input(DType::kFloat32, count, p, 7)))
          << "slice " << p;
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, AllGather, testing::ValuesIn(every_world_size()),
                         group_param_name);

}  // namespace
}  // namespace mctest
