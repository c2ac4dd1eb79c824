// broadcast over N processes: every rank ends with the root's buffer, for
// every root, on both algorithms (direct, and scatter + all-gather).
#include <gtest/gtest.h>

#include "collectives/group.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;

class Broadcast : public GroupTest {
 protected:
  void check_every_root(const GroupOptions& options) {
    run(options, [](Communicator& comm, Rank& r) {
      uint64_t seed = 200;
      for (int root = 0; root < r.size; ++root) {
        for (DType t : {DType::kUInt8, DType::kBFloat16, DType::kFloat32, DType::kInt64}) {
          for (size_t count : sample_counts()) {
            ++seed;
            const std::vector<uint8_t> sent = sample_input(t, count, root, seed);
            std::vector<uint8_t> data = r.rank == root ? sent : garbage(t, count);
            comm.broadcast(data.data(), count, t, root);
            EXPECT_TRUE(same_elements(t, data, sent))
                << mooncake::dtype_name(t) << " count " << count << " root " << root;
          }
        }
      }
    });
  }
};

TEST_P(Broadcast, EveryRankGetsTheRootsBufferOnTheDirectPath) {
  GroupOptions o = options();
  o.small_bytes = 1 << 20;
  check_every_root(o);
}

TEST_P(Broadcast, EveryRankGetsTheRootsBufferOnTheScatterAllGatherPath) {
  GroupOptions o = options();
  o.small_bytes = 1;
  check_every_root(o);
}

INSTANTIATE_TEST_SUITE_P(Worlds, Broadcast, testing::ValuesIn(every_world_size()),
                         group_param_name);

}  // namespace
}  // namespace mctest
