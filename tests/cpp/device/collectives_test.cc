// The device collectives (device/collectives.h) among processes on the GPU:
// every op against a host reference at worlds 1-3, all_to_all in several
// rounds through a small segment, and the survivors' results after a rank is
// killed. Each test needs a GPU (gpu.h).
#include "device/collectives.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "collectives/reduce.h"
#include "device/cuda.h"
#include "gpu.h"

namespace mctest {
namespace {

using mooncake::DeviceArray;
using mooncake::DeviceCollectives;
using mooncake::DType;
using mooncake::RedOp;

// A rank's device collectives, with segments of `segment_bytes`.
struct Fixture {
  explicit Fixture(Rank& r, size_t segment_bytes = 1 << 20)
      : g(r), coll(g.comm, r.store, "t/", g.device, options(segment_bytes)), stream(g.stream) {}
  static DeviceCollectives::Options options(size_t segment_bytes) {
    DeviceCollectives::Options o;
    o.segment_bytes = segment_bytes;
    return o;
  }
  GpuRank g;
  DeviceCollectives coll;
  cudaStream_t stream;
};

float value(int rank, size_t i) {
  return static_cast<float>(rank * 3 + static_cast<int>(i % 7));
}

class DeviceCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(DeviceCollectivesTest, AllReduceAndBroadcastMatchTheReference) {
  MC_REQUIRE_GPU();
  run_ranks(GetParam(),
            [](Rank& r) {
              Fixture f(r);
              const size_t n = 1001;  // past the 16-byte loads, with a tail
              ASSERT_TRUE(f.coll.serves(n * 4, 10000));
              std::vector<float> mine(n), sum(n, 0.0f);
              for (size_t i = 0; i < n; ++i) mine[i] = value(r.rank, i);
              for (int p = 0; p < r.size; ++p)
                for (size_t i = 0; i < n; ++i) sum[i] += value(p, i);
              DeviceArray<float> in(mine), out(n);
              f.coll.all_reduce(in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, f.stream);
              EXPECT_EQ(out.take(), sum);
              // In place, bf16, MAX: rounded once, as the host's reduce_arrays.
              std::vector<uint16_t> b(n), want(n);
              for (size_t i = 0; i < n; ++i) {
                b[i] = mooncake::float_to_bf16(value(r.rank, i) * 0.37f);
                want[i] = mooncake::float_to_bf16(value(r.size - 1, i) * 0.37f);
              }
              DeviceArray<uint16_t> bb(b);
              f.coll.all_reduce(bb.get(), bb.get(), n, DType::kBFloat16, RedOp::kMax, f.stream);
              EXPECT_EQ(bb.take(), want);
              // broadcast from the last rank: the others' buffers are overwritten.
              const int root = r.size - 1;
              DeviceArray<float> bc(r.rank == root ? mine : std::vector<float>(n, -1.0f));
              f.coll.broadcast(bc.get(), bc.get(), n, DType::kFloat32, root, f.stream);
              std::vector<float> from_root(n);
              for (size_t i = 0; i < n; ++i) from_root[i] = value(root, i);
              EXPECT_EQ(bc.take(), from_root);
            },
            {60000});
}

TEST_P(DeviceCollectivesTest, AllGatherAndReduceScatterMatchTheReference) {
  MC_REQUIRE_GPU();
  run_ranks(
      GetParam(),
      [](Rank& r) {
        Fixture f(r);
        const size_t n = 333;
        std::vector<float> mine(n);
        for (size_t i = 0; i < n; ++i) mine[i] = value(r.rank, i);
        DeviceArray<float> in(mine), all(n * r.size);
        std::vector<void*> outs;
        for (int p = 0; p < r.size; ++p) outs.push_back(all.get() + p * n);
        f.coll.all_gather(in.get(), n, DType::kFloat32, outs.data(), f.stream);
        const std::vector<float> got = all.take();
        for (int p = 0; p < r.size; ++p)
          for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[p * n + i], value(p, i)) << p << " " << i;
        // reduce_scatter: this rank's contribution to shard p is value(rank + p),
        // from one packed array and from separate ones.
        std::vector<float> packed(n * r.size), want(n, 0.0f);
        for (int p = 0; p < r.size; ++p)
          for (size_t i = 0; i < n; ++i) packed[p * n + i] = value(r.rank + p, i);
        for (int q = 0; q < r.size; ++q)
          for (size_t i = 0; i < n; ++i) want[i] += value(q + r.rank, i);
        DeviceArray<float> src(packed), out(n);
        std::vector<const void*> ins;
        for (int p = 0; p < r.size; ++p) ins.push_back(src.get() + p * n);
        f.coll.reduce_scatter(ins.data(), out.get(), n, DType::kFloat32, RedOp::kSum, f.stream);
        EXPECT_EQ(out.take(), want);
        std::vector<std::unique_ptr<DeviceArray<float>>> apart;
        ins.clear();
        for (int p = 0; p < r.size; ++p) {
          apart.push_back(std::make_unique<DeviceArray<float>>(
              std::vector<float>(packed.begin() + p * n, packed.begin() + (p + 1) * n)));
          ins.push_back(apart.back()->get());
        }
        DeviceArray<float> out2(n);
        f.coll.reduce_scatter(ins.data(), out2.get(), n, DType::kFloat32, RedOp::kSum, f.stream);
        EXPECT_EQ(out2.take(), want);
      },
      {60000});
}

TEST_P(DeviceCollectivesTest, AllToAllOfUnevenSizesInSeveralRounds) {
  MC_REQUIRE_GPU();
  run_ranks(GetParam(),
            [](Rank& r) {
              Fixture f(r, 16 << 10);  // a small segment: large edges take several rounds
              // Rank a sends rank b (a + 2b) * 1500 + 1 floats, valued a * 1e6 + b * 1e4 + i.
              auto count = [](int a, int b) { return static_cast<size_t>((a + 2 * b) * 1500 + 1); };
              std::vector<size_t> in_counts, out_counts;
              std::vector<std::unique_ptr<DeviceArray<float>>> in, out;
              std::vector<const void*> ins;
              std::vector<void*> outs;
              for (int p = 0; p < r.size; ++p) {
                in_counts.push_back(count(r.rank, p));
                out_counts.push_back(count(p, r.rank));
                std::vector<float> v(in_counts.back());
                for (size_t i = 0; i < v.size(); ++i)
                  v[i] = r.rank * 1e6f + p * 1e4f + static_cast<float>(i % 5000);
                in.push_back(std::make_unique<DeviceArray<float>>(v));
                out.push_back(std::make_unique<DeviceArray<float>>(out_counts.back()));
                ins.push_back(in.back()->get());
                outs.push_back(out.back()->get());
              }
              f.coll.all_to_all(ins.data(), in_counts.data(), outs.data(), out_counts.data(),
                                DType::kFloat32, f.stream);
              for (int p = 0; p < r.size; ++p) {
                const std::vector<float> got = out[p]->take();
                for (size_t i = 0; i < got.size(); ++i)
                  ASSERT_EQ(got[i], p * 1e6f + r.rank * 1e4f + static_cast<float>(i % 5000))
                      << "from " << p << " at " << i;
              }
            },
            {60000});
}

INSTANTIATE_TEST_SUITE_P(Worlds, DeviceCollectivesTest, ::testing::Values(1, 2, 3));

TEST(DeviceCollectives, SurvivorsGoOnWhenARankDies) {
  MC_REQUIRE_GPU();
  run_ranks(3,
            [](Rank& r) {
              Fixture f(r);
              const size_t n = 4096;
              DeviceArray<float> v(std::vector<float>(n, 1.0f));
              f.coll.all_reduce(v.get(), v.get(), n, DType::kFloat32, RedOp::kSum, f.stream);
              EXPECT_EQ(v.take()[0], 3.0f);
              f.g.comm.barrier();
              if (r.rank == 2) exit_rank_abruptly();  // gone, as after a crash
              // The survivors' next ops find it gone, agree on {0, 1} and cover it alone.
              DeviceArray<float> w(std::vector<float>(n, static_cast<float>(r.rank + 1)));
              f.coll.all_reduce(w.get(), w.get(), n, DType::kFloat32, RedOp::kSum, f.stream);
              EXPECT_EQ(w.take(), std::vector<float>(n, 3.0f));
              EXPECT_FALSE(f.g.comm.view().is_member(2));
              // all_gather zero-fills the dead rank's slice.
              DeviceArray<float> in(std::vector<float>(n, 7.0f)), all(3 * n);
              cudaMemset(all.get(), 0xff, 3 * n * sizeof(float));
              std::vector<void*> outs{all.get(), all.get() + n, all.get() + 2 * n};
              f.coll.all_gather(in.get(), n, DType::kFloat32, outs.data(), f.stream);
              const std::vector<float> got = all.take();
              EXPECT_EQ(got[0], 7.0f);
              EXPECT_EQ(got[n], 7.0f);
              EXPECT_EQ(got[2 * n], 0.0f);
            },
            {60000});
}

}  // namespace
}  // namespace mctest
