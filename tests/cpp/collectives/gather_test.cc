// gather over N processes: slice p of the root's output is rank p's input,
// for every root.
#include <gtest/gtest.h>

#include "collectives/group.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;

class Gather : public GroupTest {};

TEST_P(Gather, RootGetsEveryRanksInputInRankOrder) {
  run([](Communicator& comm, Rank& r) {
    uint64_t seed = 600;
    for (int root = 0; root < r.size; ++root) {
      for (DType t : {DType::kInt16, DType::kFloat32}) {
        for (size_t count : sample_counts()) {
          ++seed;
          const std::vector<uint8_t> in = sample_input(t, count, r.rank, seed);
          std::vector<std::vector<uint8_t>> outs;
          if (r.rank == root) outs.assign(r.size, garbage(t, count));
          comm.gather(in.data(), count, t, r.rank == root ? pointers(outs).data() : nullptr, root);
          for (size_t p = 0; p < outs.size(); ++p)
            EXPECT_TRUE(
                same_elements(t, outs[p], sample_input(t, count, static_cast<int>(p), seed)))
                << mooncake::dtype_name(t) << " count " << count << " root " << root << " slice "
                << p;
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Gather, testing::ValuesIn(every_world_size()), group_param_name);

}  // namespace
}  // namespace mctest
