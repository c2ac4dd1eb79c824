// all_gather over N processes: slice p of every rank's output is rank p's input.
#include <gtest/gtest.h>

#include <algorithm>

#include "collectives/group.h"
#include "collectives/reference.h"
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

// Past 4 MiB received in one exchange the pieces are written past the cache
// (core/copy.h): every op that moves data through an exchange, at sizes that
// take that path, with 64 KiB pieces, against the reference.
TEST_P(AllGather, ExchangesPastFourMiBArriveWhole) {
  GroupOptions o = options();
  o.chunk_bytes = 64 << 10;
  run(o, [](Communicator& comm, Rank& r) {
    const DType t = DType::kInt32;
    const size_t count =
        (size_t{4} << 20) / 4 / static_cast<size_t>(std::max(1, r.size - 1)) + 4099;
    const std::vector<uint8_t> in = sample_input(t, count, r.rank, 41);
    {  // all_gather
      std::vector<std::vector<uint8_t>> outs(r.size, garbage(t, count));
      comm.all_gather(in.data(), count, t, pointers(outs).data());
      for (int p = 0; p < r.size; ++p)
        EXPECT_TRUE(same_elements(t, outs[p], sample_input(t, count, p, 41))) << "slice " << p;
    }
    {  // all_to_all: rank p's piece for this rank is its input, seeded by this rank
      std::vector<std::vector<uint8_t>> ins, outs(r.size, garbage(t, count));
      for (int p = 0; p < r.size; ++p) ins.push_back(sample_input(t, count, r.rank, 50 + p));
      std::vector<size_t> counts(r.size, count);
      comm.all_to_all(const_pointers(ins).data(), counts.data(), pointers(outs).data(),
                      counts.data(), t);
      for (int p = 0; p < r.size; ++p)
        EXPECT_TRUE(same_elements(t, outs[p], sample_input(t, count, p, 50 + r.rank)))
            << "from " << p;
    }
    {  // broadcast from the last rank
      const size_t big = count * static_cast<size_t>(r.size);
      std::vector<uint8_t> v =
          r.rank == r.size - 1 ? sample_input(t, big, r.rank, 60) : garbage(t, big);
      comm.broadcast(v.data(), big, t, r.size - 1);
      EXPECT_TRUE(same_elements(t, v, sample_input(t, big, r.size - 1, 60))) << "broadcast";
    }
    {  // all_reduce: its all-gather receives the others' reduced shards
      const size_t big = count * static_cast<size_t>(r.size);
      std::vector<uint8_t> v = sample_input(t, big, r.rank, 70);
      std::vector<std::vector<uint8_t>> all;
      for (int p = 0; p < r.size; ++p) all.push_back(sample_input(t, big, p, 70));
      comm.all_reduce(v.data(), big, t, mooncake::RedOp::kSum);
      EXPECT_TRUE(same_elements(
          t, v, reference_reduce(t, mooncake::RedOp::kSum, const_pointers(all), big, r.size)))
          << "all_reduce";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, AllGather, testing::ValuesIn(every_world_size()),
                         group_param_name);

}  // namespace
}  // namespace mctest
