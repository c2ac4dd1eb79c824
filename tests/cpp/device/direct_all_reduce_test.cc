// The device-driven all_reduce (DeviceCollectives::direct_all_reduce,
// device/direct_all_reduce.h) among processes on the GPU: one-shot and
// two-shot against the host's reduce_arrays and the host-driven plane, bit for
// bit, over dtypes, ops, sizes and misaligned pointers at worlds 1-3; a launch
// captured in a CUDA graph and replayed with new inputs, eager launches in
// between; calls that disagree; and a rank that dies between replays: the
// survivors mask it at once, and set the path up again without it once the
// host has agreed on the new view. Each test needs a GPU (gpu.h).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "collectives/reduce.h"
#include "device/collectives.h"
#include "device/cuda.h"
#include "gpu.h"
#include "kernels/coll/direct.h"

namespace mctest {
namespace {

using mooncake::DeviceArray;
using mooncake::DeviceCollectives;
using mooncake::DType;
using mooncake::RedOp;
using Direct = DeviceCollectives::Direct;

DeviceCollectives::Options options(Direct direct, size_t segment_bytes = 1 << 20) {
  DeviceCollectives::Options o;
  o.segment_bytes = segment_bytes;
  o.direct = direct;
  return o;
}

// Rank `rank`'s `n` elements of `dtype` for call `tag`: small values, signed
// where the type is, scaled by 0.37 for floating types (so sums round, and
// the order of the sources shows in the bits).
std::vector<uint8_t> input(DType dtype, size_t n, int rank, int tag) {
  const size_t esize = mooncake::dtype_size(dtype);
  std::vector<uint8_t> out(n * esize);
  for (size_t i = 0; i < n; ++i) {
    const int v = static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13 + tag * 5) % 23) - 11;
    const float f = static_cast<float>(v) * 0.37f;
    uint8_t* e = out.data() + i * esize;
    auto put = [&](auto x) { std::memcpy(e, &x, sizeof(x)); };
    switch (dtype) {
      case DType::kBool: put(static_cast<uint8_t>(v & 1)); break;
      case DType::kUInt8: put(static_cast<uint8_t>(v)); break;
      case DType::kInt8: put(static_cast<int8_t>(v)); break;
      case DType::kInt16: put(static_cast<int16_t>(v)); break;
      case DType::kInt32: put(static_cast<int32_t>(v)); break;
      case DType::kInt64: put(static_cast<int64_t>(v)); break;
      case DType::kUInt16: put(static_cast<uint16_t>(v)); break;
      case DType::kUInt32: put(static_cast<uint32_t>(v)); break;
      case DType::kUInt64: put(static_cast<uint64_t>(v)); break;
      case DType::kFloat16: put(mooncake::float_to_half(f)); break;
      case DType::kBFloat16: put(mooncake::float_to_bf16(f)); break;
      case DType::kFloat32: put(f); break;
      case DType::kFloat64: put(static_cast<double>(f)); break;
      default: ADD_FAILURE() << "no input for dtype " << static_cast<int>(dtype);
    }
  }
  return out;
}

// The host's reduction of every rank's input for call `tag`, in rank order.
std::vector<uint8_t> reference(DType dtype, RedOp op, size_t n, int world, int tag) {
  std::vector<std::vector<uint8_t>> ins;
  std::vector<const void*> srcs;
  for (int p = 0; p < world; ++p) ins.push_back(input(dtype, n, p, tag));
  for (auto& v : ins) srcs.push_back(v.data());
  std::vector<uint8_t> out(n * mooncake::dtype_size(dtype));
  mooncake::reduce_arrays(dtype, op, out.data(), srcs.data(), world, n, world);
  return out;
}

std::vector<uint8_t> read(const void* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  mooncake::cuda_check(cudaMemcpy(out.data(), p, bytes, cudaMemcpyDeviceToHost), "read back");
  return out;
}

void write(void* p, const std::vector<uint8_t>& bytes) {
  mooncake::cuda_check(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "write");
}

struct Sweep {
  DType dtype;
  RedOp op;
};
// Every element type once, through every op kind (AVG and the fp32
// accumulation of the 16-bit floats; wrapping integer products; bitwise).
const Sweep kSweep[] = {
    {DType::kFloat32, RedOp::kSum}, {DType::kBFloat16, RedOp::kAvg},
    {DType::kFloat16, RedOp::kMin}, {DType::kFloat64, RedOp::kProduct},
    {DType::kInt64, RedOp::kMax},   {DType::kInt32, RedOp::kProduct},
    {DType::kInt16, RedOp::kSum},   {DType::kInt8, RedOp::kBxor},
    {DType::kUInt8, RedOp::kBor},   {DType::kUInt16, RedOp::kMin},
    {DType::kUInt32, RedOp::kBand}, {DType::kUInt64, RedOp::kSum},
    {DType::kBool, RedOp::kMax},
};

// No GPU needed: every two-shot share fits its slot, for any world and size
// up to the area's largest op, and starts on a 16-byte boundary.
TEST(DirectLayout, EveryShareFitsItsSlot) {
  for (size_t max : {size_t{1}, size_t{1000}, size_t{4096}, size_t{65536}, size_t{8} << 20}) {
    const auto l = mooncake::kernels::DirectLayout::of(max);
    EXPECT_EQ(l.input(1) - l.input(0), l.parity_bytes);
    EXPECT_EQ(l.total_bytes, l.input(1) + l.parity_bytes);
    EXPECT_EQ(l.share(0) % 256, 0u);
    for (size_t esize : {size_t{1}, size_t{2}, size_t{4}, size_t{8}})
      for (int ranks : {2, 3, 4, 7, 8, 64})
        for (size_t count : {max / esize, max / esize - max / esize / 3, size_t{1}}) {
          if (count == 0) continue;
          const size_t per = mooncake::kernels::direct_share_elems(count, ranks, esize);
          EXPECT_EQ(per * esize % 16, 0u);
          EXPECT_GE(per * static_cast<size_t>(ranks), count);
          EXPECT_LE(per * esize, l.share_bytes) << max << " " << esize << " " << ranks;
        }
  }
}

// A wait settles on this op or a later one of its generation, or on a newer
// generation; never on an older generation or an earlier op (zeroed memory).
TEST(DirectLayout, SignalsSettleOnlyOnThisOpOrLater) {
  using mooncake::kernels::direct_tag;
  using mooncake::kernels::tag_ahead;
  using mooncake::kernels::tag_settled;
  EXPECT_FALSE(tag_settled(0, 1, 1));
  EXPECT_FALSE(tag_settled(direct_tag(1, 4), 1, 5));
  EXPECT_TRUE(tag_settled(direct_tag(1, 5), 1, 5));
  EXPECT_TRUE(tag_settled(direct_tag(1, 6), 1, 5));
  EXPECT_EQ(tag_ahead(direct_tag(1, 6), 5), 1u);
  EXPECT_FALSE(tag_settled(direct_tag(3, 9), 4, 1));
  EXPECT_TRUE(tag_settled(direct_tag(5, 1), 4, 9));
  // Past 2^32 ops the numbers wrap, and still compare.
  EXPECT_TRUE(tag_settled(direct_tag(1, (uint64_t{1} << 32) + 2), 1, (uint64_t{1} << 32) - 1));
  EXPECT_FALSE(tag_settled(direct_tag(1, (uint64_t{1} << 32) - 1), 1, (uint64_t{1} << 32) + 2));
}

class DirectAllReduceTest : public ::testing::TestWithParam<int> {};

TEST_P(DirectAllReduceTest, EqualsTheHostAndThePlaneBitForBit) {
  MC_REQUIRE_GPU();
  run_ranks(
      GetParam(),
      [](Rank& r) {
        GpuRank g(r);
        int tag = 0;
        for (Direct algo : {Direct::kOneShot, Direct::kTwoShot}) {
          DeviceCollectives c(g.comm, r.store, "d" + std::to_string(static_cast<int>(algo)) + "/",
                              g.device, options(algo));
          // 7: a tail only; 1001: vectors and a tail; 70000: several blocks (the
          // first sweeps only, for time).
          for (size_t n : {size_t{7}, size_t{1001}, size_t{70000}}) {
            for (const Sweep& s : kSweep) {
              if (n > 1001 && &s - kSweep >= 4) break;
              ++tag;
              const size_t bytes = n * mooncake::dtype_size(s.dtype);
              const std::vector<uint8_t> want = reference(s.dtype, s.op, n, r.size, tag);
              // The input one element past a 16-byte boundary, every other round:
              // the scalar paths.
              const size_t skew = (tag % 2) * mooncake::dtype_size(s.dtype);
              DeviceArray<uint8_t> in(bytes + 16), out(bytes + 16), plane(bytes);
              write(in.get() + skew, input(s.dtype, n, r.rank, tag));
              c.direct_all_reduce(in.get() + skew, out.get() + skew, n, s.dtype, s.op, g.stream);
              c.all_reduce(in.get() + skew, plane.get(), n, s.dtype, s.op, g.stream);
              mooncake::cuda_check(cudaStreamSynchronize(g.stream), "sync");
              const std::string what = "algo " + std::to_string(static_cast<int>(algo)) +
                                       " dtype " + std::to_string(static_cast<int>(s.dtype)) +
                                       " op " + std::to_string(static_cast<int>(s.op)) + " n " +
                                       std::to_string(n) + " skew " + std::to_string(skew);
              ASSERT_EQ(read(out.get() + skew, bytes), want) << what;
              ASSERT_EQ(read(plane.get(), bytes), want) << what;
            }
          }
          // In place, and nothing masked or reported on the way.
          const size_t n = 5000;
          ++tag;
          DeviceArray<uint8_t> x(n * 4);
          write(x.get(), input(DType::kFloat32, n, r.rank, tag));
          c.direct_all_reduce(x.get(), x.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
          EXPECT_EQ(read(x.get(), n * 4), reference(DType::kFloat32, RedOp::kSum, n, r.size, tag));
          EXPECT_TRUE(c.direct_ready());
        }
      },
      {120000});
}

// A launch captured in a graph reads its state from device memory: replays
// take new inputs, and eager launches in between keep the ranks' numbering
// in step.
TEST_P(DirectAllReduceTest, CapturedAndReplayedEqualsEager) {
  MC_REQUIRE_GPU();
  run_ranks(
      GetParam(),
      [](Rank& r) {
        GpuRank g(r);
        for (Direct algo : {Direct::kOneShot, Direct::kTwoShot}) {
          DeviceCollectives c(g.comm, r.store, "g" + std::to_string(static_cast<int>(algo)) + "/",
                              g.device, options(algo));
          const size_t n = algo == Direct::kOneShot ? 1024 : 100000;  // 4 KiB; 400 KB
          const size_t bytes = n * 4;
          DeviceArray<uint8_t> in(bytes), out(bytes), eager(bytes);
          write(in.get(), input(DType::kFloat32, n, r.rank, 0));
          // The first call sets the path up (a host op): never under capture.
          EXPECT_FALSE(c.direct_ready());
          c.direct_all_reduce(in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
          ASSERT_TRUE(c.direct_ready());
          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          mooncake::cuda_check(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal),
                               "begin capture");
          c.direct_all_reduce(in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
          mooncake::cuda_check(cudaStreamEndCapture(g.stream, &graph), "end capture");
          mooncake::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
          for (int k = 1; k <= 6; ++k) {
            write(in.get(), input(DType::kFloat32, n, r.rank, k));
            mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
            if (k % 3 == 0)  // an eager call between replays, on another buffer
              c.direct_all_reduce(in.get(), eager.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
            mooncake::cuda_check(cudaStreamSynchronize(g.stream), "sync");
            const auto want = reference(DType::kFloat32, RedOp::kSum, n, r.size, k);
            ASSERT_EQ(read(out.get(), bytes), want) << "replay " << k;
            if (k % 3 == 0) ASSERT_EQ(read(eager.get(), bytes), want) << "eager " << k;
          }
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(graph);
        }
      },
      {120000});
}

INSTANTIATE_TEST_SUITE_P(Worlds, DirectAllReduceTest, ::testing::Values(1, 2, 3));

// Ranks that call with different counts each leave the other out of that op,
// and the next matching call covers both: they stay in step.
TEST(DirectAllReduce, CallsThatDisagreeLeaveEachOtherOut) {
  MC_REQUIRE_GPU();
  run_ranks(2,
            [](Rank& r) {
              GpuRank g(r);
              DeviceCollectives c(g.comm, r.store, "m/", g.device, options(Direct::kAuto));
              const size_t n = 64;
              DeviceArray<float> x(std::vector<float>(n + 1, 1.0f));
              c.direct_all_reduce(x.get(), x.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
              EXPECT_EQ(x.take()[0], 2.0f);
              const size_t mine = r.rank == 0 ? n : n + 1;
              DeviceArray<float> y(std::vector<float>(n + 1, 1.0f));
              c.direct_all_reduce(y.get(), y.get(), mine, DType::kFloat32, RedOp::kSum, g.stream);
              EXPECT_EQ(y.take()[0], 1.0f);  // its own input alone
              DeviceArray<float> z(std::vector<float>(n, 1.0f));
              c.direct_all_reduce(z.get(), z.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
              EXPECT_EQ(z.take(), std::vector<float>(n, 2.0f));
            },
            {60000});
}

// A rank dies between replays: the survivors' launches hear it from the host
// (the lost words) and mask it at once, far before the 60 s deadline; an op on
// the host then has them agree on a view without it, and the next call sets
// the path up among them, which the graph, captured before, runs with too.
TEST(DirectAllReduce, SurvivorsMaskADeadRankAndSetUpAgainWithoutIt) {
  MC_REQUIRE_GPU();
  run_ranks(
      3,
      [](Rank& r) {
        GpuRank g(r);
        DeviceCollectives c(g.comm, r.store, "k/", g.device, options(Direct::kAuto));
        const size_t n = 4096;
        DeviceArray<float> in(std::vector<float>(n, 1.0f)), out(n);
        c.direct_all_reduce(in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream, 60000);
        EXPECT_EQ(out.take(), std::vector<float>(n, 3.0f));
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        mooncake::cuda_check(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal),
                             "begin capture");
        c.direct_all_reduce(in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream, 60000);
        mooncake::cuda_check(cudaStreamEndCapture(g.stream, &graph), "end capture");
        mooncake::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        EXPECT_EQ(out.take(), std::vector<float>(n, 3.0f));
        g.comm.barrier();
        if (r.rank == 2) exit_rank_abruptly();  // gone, as after a crash
        const auto t0 = std::chrono::steady_clock::now();
        out.put(std::vector<float>(n, -1.0f));
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        mooncake::cuda_check(cudaStreamSynchronize(g.stream), "sync");
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
        EXPECT_EQ(out.take(), std::vector<float>(n, 2.0f));
        // Masked for good: the next launch does not wait for it.
        c.direct_all_reduce(in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream, 60000);
        EXPECT_EQ(out.take(), std::vector<float>(n, 2.0f));
        // An op on the host finds it gone: the survivors agree on {0, 1}.
        DeviceArray<float> h(std::vector<float>(n, 1.0f));
        c.all_reduce(h.get(), h.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
        EXPECT_EQ(h.take(), std::vector<float>(n, 2.0f));
        EXPECT_FALSE(g.comm.view().is_member(2));
        EXPECT_FALSE(c.direct_ready());  // a new view: set up again
        c.direct_all_reduce(in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream, 60000);
        EXPECT_TRUE(c.direct_ready());
        EXPECT_EQ(out.take(), std::vector<float>(n, 2.0f));
        out.put(std::vector<float>(n, -1.0f));
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        EXPECT_EQ(out.take(), std::vector<float>(n, 2.0f));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      },
      {60000});
}

}  // namespace
}  // namespace mctest
