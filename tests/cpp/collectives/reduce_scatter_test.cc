// reduce_scatter over N processes: rank p ends with the rank-ordered
// reduction of every rank's contribution to shard p.
#include <gtest/gtest.h>

#include <algorithm>

#include "collectives/group.h"
#include "collectives/reference.h"
#include "collectives/samples.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::RedOp;

// Rank q's contribution to shard p, for a test seed.
std::vector<uint8_t> contribution(DType t, size_t count, int q, int p, uint64_t seed) {
  return sample_input(t, count, q, seed * 64 + static_cast<uint64_t>(p), /*with_nan=*/true);
}

class ReduceScatter : public GroupTest {};

TEST_P(ReduceScatter, EveryShardIsTheReferenceReductionOfItsContributions) {
  run([](Communicator& comm, Rank& r) {
    uint64_t seed = 400;
    for (const DtypeOp& pair : supported_pairs()) {
      for (size_t count : sample_counts()) {
        ++seed;
        std::vector<std::vector<uint8_t>> mine;  // this rank's contribution to each shard
        for (int p = 0; p < r.size; ++p)
          mine.push_back(contribution(pair.dtype, count, r.rank, p, seed));
        std::vector<uint8_t> out = garbage(pair.dtype, count);
        comm.reduce_scatter(const_pointers(mine).data(), out.data(), count, pair.dtype, pair.op);
        std::vector<std::vector<uint8_t>> to_me;  // every rank's contribution to this shard
        for (int q = 0; q < r.size; ++q)
          to_me.push_back(contribution(pair.dtype, count, q, r.rank, seed));
        EXPECT_TRUE(same_elements(
            pair.dtype, out,
            reference_reduce(pair.dtype, pair.op, const_pointers(to_me), count, r.size)))
            << mooncake::dtype_name(pair.dtype) << " " << mooncake::redop_name(pair.op) << " count "
            << count;
      }
    }
  });
}

// A small whole input (at most small_bytes / N, and one message) is
// all-reduced in one round (one message to each peer); a larger one
// reduce-scatters and then commits.
TEST_P(ReduceScatter, SmallWholeInputTakesOneRound) {
  run([](Communicator& comm, Rank& r) {
    const size_t n = static_cast<size_t>(r.size);
    const size_t limit =
        std::min(comm.config().small_bytes / n, comm.collective_channels().layout().chunk_bytes);
    const uint64_t peers = static_cast<uint64_t>(r.size - 1);
    const size_t largest = limit / sizeof(float) / n;  // floats per shard
    ASSERT_GE(largest, 1u);
    for (size_t count : {size_t{1}, largest, largest + 1}) {
      std::vector<std::vector<float>> ins(r.size, std::vector<float>(count, 1.0f));
      std::vector<float> out(count, -1.0f);
      const uint64_t before = comm.collective_channels().messages_sent();
      comm.reduce_scatter(const_pointers(ins).data(), out.data(), count, DType::kFloat32,
                          RedOp::kSum);
      const uint64_t sent = comm.collective_channels().messages_sent() - before;
      if (count <= largest)
        EXPECT_EQ(sent, peers) << count << " floats";
      else  // the data, then the commit round
        EXPECT_GE(sent, 2 * peers) << count << " floats";
      EXPECT_EQ(out, std::vector<float>(count, static_cast<float>(r.size)));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReduceScatter, testing::ValuesIn(every_world_size()),
                         group_param_name);

}  // namespace
}  // namespace mctest
