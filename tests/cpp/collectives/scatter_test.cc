// scatter over N processes: every rank p gets slice p of the root's input,
// for every root.
#include <gtest/gtest.h>

#include "collectives/group.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;

// Slice `p` of the root's input.
std::vector<uint8_t> slice(DType t, size_t count, int root, int p, uint64_t seed) {
  return sample_input(t, count, root, seed * 64 + static_cast<uint64_t>(p));
}

class Scatter : public GroupTest {};

TEST_P(Scatter, EveryRankGetsItsSliceOfTheRootsInput) {
  run([](Communicator& comm, Rank& r) {
    uint64_t seed = 700;
    for (int root = 0; root < r.size; ++root) {
      for (DType t : {DType::kUInt32, DType::kBFloat16}) {
        for (size_t count : sample_counts()) {
          ++seed;
          std::vector<std::vector<uint8_t>> ins;
          if (r.rank == root)
            for (int p = 0; p < r.size; ++p) ins.push_back(slice(t, count, root, p, seed));
          std::vector<uint8_t> out = garbage(t, count);
          comm.scatter(r.rank == root ? const_pointers(ins).data() : nullptr, out.data(), count, t,
                       root);
          EXPECT_TRUE(same_elements(t, out, slice(t, count, root, r.rank, seed)))
              << mooncake::dtype_name(t) << " count " << count << " root " << root;
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Scatter, testing::ValuesIn(every_world_size()), group_param_name);

}  // namespace
}  // namespace mctest
