// all_reduce over N processes: every rank ends with the reduction of all
// ranks' inputs, combined in rank order, bit-equal to the local reference,
// for every dtype × op and every sample size, on both algorithms.
#include <gtest/gtest.h>

#include "collectives/group.h"
#include "collectives/reference.h"
#include "collectives/samples.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::RedOp;

class AllReduce : public GroupTest {
 protected:
  // Runs every supported (dtype, op) over every sample count and checks the result.
  void check_every_dtype_and_op(const GroupOptions& options) {
    run(options, [](Communicator& comm, Rank& r) {
      uint64_t seed = 0;
      for (const DtypeOp& p : supported_pairs()) {
        for (size_t count : sample_counts()) {
          ++seed;
          std::vector<std::vector<uint8_t>> inputs;
          for (int q = 0; q < r.size; ++q)
            inputs.push_back(sample_input(p.dtype, count, q, seed, /*with_nan=*/true));
          std::vector<uint8_t> data = inputs[r.rank];
          comm.all_reduce(data.data(), count, p.dtype, p.op);
          EXPECT_TRUE(
              same_elements(p.dtype, data,
                            reference_reduce(p.dtype, p.op, const_pointers(inputs), count, r.size)))
              << mooncake::dtype_name(p.dtype) << " " << mooncake::redop_name(p.op) << " count "
              << count;
        }
      }
    });
  }
};

TEST_P(AllReduce, EveryDtypeAndOpMatchesTheReferenceOnTheDirectPath) {
  GroupOptions o = options();
  o.small_bytes = 1 << 20;  // every sample goes direct, the large one in many chunks
  check_every_dtype_and_op(o);
}

TEST_P(AllReduce, EveryDtypeAndOpMatchesTheReferenceOnTheReduceScatterAllGatherPath) {
  GroupOptions o = options();
  o.small_bytes = 1;  // every sample with at least one element per rank goes two-phase
  check_every_dtype_and_op(o);
}

TEST_P(AllReduce, SixteenBitFloatSumsAreRoundedOnceAfterFloat32Accumulation) {
  run([](Communicator& comm, Rank& r) {
    // big + 1 + 1 + ...: rounding after every step would stay at `big`, where
    // the spacing of the 16-bit type is 2.
    for (DType t : {DType::kFloat16, DType::kBFloat16}) {
      auto encode = t == DType::kFloat16 ? ref_float_to_half : ref_float_to_bf16;
      const float big = t == DType::kFloat16 ? 2048.0f : 256.0f;
      std::vector<uint16_t> data(5, encode(r.rank == 0 ? big : 1.0f));
      comm.all_reduce(data.data(), data.size(), t, RedOp::kSum);
      for (uint16_t v : data)
        EXPECT_EQ(v, encode(big + static_cast<float>(r.size - 1))) << mooncake::dtype_name(t);
    }
  });
}

TEST_P(AllReduce, UnsupportedOpIsRejectedOnEveryRankBeforeAnyTransfer) {
  run([](Communicator& comm, Rank& r) {
    std::vector<int32_t> data(4, r.rank);
    EXPECT_TRUE(throws_error(mooncake::ErrorKind::kInvalidArgument, [&] {
      comm.all_reduce(data.data(), data.size(), DType::kInt32, RedOp::kAvg);
    }));
    comm.all_reduce(data.data(), data.size(), DType::kInt32, RedOp::kSum);
    EXPECT_EQ(data[0], r.size * (r.size - 1) / 2);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, AllReduce, testing::ValuesIn(every_world_size()),
                         group_param_name);

}  // namespace
}  // namespace mctest
