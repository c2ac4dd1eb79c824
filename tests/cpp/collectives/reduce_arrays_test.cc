// reduce_arrays, the CPU reduction under every collective: every dtype × op
// matches the reference for 1 to 7 sources and counts across block
// boundaries; integers wrap, bool ops are logical, NaN wins MIN/MAX, 16-bit
// floats round once, AVG divides by its divisor; undefined pairs are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "collectives/reduce.h"
#include "collectives/reference.h"
#include "collectives/samples.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::DType;
using mooncake::RedOp;
using mooncake::reduce_arrays;

std::vector<uint8_t> reduce(DType t, RedOp op, const std::vector<std::vector<uint8_t>>& srcs,
                            size_t count, int divisor) {
  std::vector<uint8_t> out(count * mooncake::dtype_size(t), 0xCC);
  auto ptrs = std::vector<const void*>();
  for (auto& s : srcs) ptrs.push_back(s.data());
  reduce_arrays(t, op, out.data(), ptrs.data(), static_cast<int>(ptrs.size()), count, divisor);
  return out;
}

template <typename T>
std::vector<uint8_t> bytes(std::initializer_list<T> values) {
  std::vector<uint8_t> out(values.size() * sizeof(T));
  std::memcpy(out.data(), std::data(values), out.size());
  return out;
}

template <typename T>
T first(const std::vector<uint8_t>& b) {
  T v;
  std::memcpy(&v, b.data(), sizeof(T));
  return v;
}

TEST(ReduceArrays, EveryDtypeAndOpMatchesTheReference) {
  uint64_t seed = 0;
  for (const DtypeOp& p : supported_pairs()) {
    for (int nsrc : {1, 2, 3, 4, 7}) {  // each pass of the loop: first, middle, last
      for (size_t count : {size_t{1}, size_t{2047}, size_t{2049}, size_t{5000}}) {
        ++seed;
        std::vector<std::vector<uint8_t>> srcs;
        for (int s = 0; s < nsrc; ++s)
          srcs.push_back(sample_input(p.dtype, count, s, seed, /*with_nan=*/true));
        EXPECT_TRUE(
            same_elements(p.dtype, reduce(p.dtype, p.op, srcs, count, nsrc),
                          reference_reduce(p.dtype, p.op, const_pointers(srcs), count, nsrc)))
            << mooncake::dtype_name(p.dtype) << " " << mooncake::redop_name(p.op) << ", " << nsrc
            << " sources, count " << count;
      }
    }
  }
}

TEST(ReduceArrays, TheOutputMayBeTheFirstSource) {
  for (const DtypeOp& p : supported_pairs()) {
    for (int nsrc : {1, 2, 3, 4}) {
      std::vector<std::vector<uint8_t>> srcs;
      for (int s = 0; s < nsrc; ++s) srcs.push_back(sample_input(p.dtype, 3000, s, 9));
      const auto want = reference_reduce(p.dtype, p.op, const_pointers(srcs), 3000, nsrc);
      auto ptrs = const_pointers(srcs);
      reduce_arrays(p.dtype, p.op, srcs[0].data(), ptrs.data(), nsrc, 3000, nsrc);
      EXPECT_TRUE(same_elements(p.dtype, srcs[0], want))
          << mooncake::dtype_name(p.dtype) << " " << mooncake::redop_name(p.op) << ", " << nsrc
          << " sources";
    }
  }
}

TEST(ReduceArrays, SixteenBitFloatsAccumulateInFloat32AndRoundOnce) {
  // big + 1 + 1: rounding after each step would stay at big (spacing 2 there).
  const auto h = [](float f) { return ref_float_to_half(f); };
  const auto b = [](float f) { return ref_float_to_bf16(f); };
  EXPECT_EQ(
      first<uint16_t>(reduce(
          DType::kFloat16, RedOp::kSum,
          {bytes<uint16_t>({h(2048)}), bytes<uint16_t>({h(1)}), bytes<uint16_t>({h(1)})}, 1, 3)),
      h(2050));
  EXPECT_EQ(
      first<uint16_t>(reduce(
          DType::kBFloat16, RedOp::kSum,
          {bytes<uint16_t>({b(256)}), bytes<uint16_t>({b(1)}), bytes<uint16_t>({b(1)})}, 1, 3)),
      b(258));
  // AVG rounds once too: (2048 + 1 + 1) / 2 = 1025 exactly.
  EXPECT_EQ(
      first<uint16_t>(reduce(
          DType::kFloat16, RedOp::kAvg,
          {bytes<uint16_t>({h(2048)}), bytes<uint16_t>({h(1)}), bytes<uint16_t>({h(1)})}, 1, 2)),
      h(1025));
}

// Every 16-bit pattern of float16 and bfloat16 (NaNs, infinities, subnormals,
// signed zeros), against a partner pattern, through the whole loop (which on
// x86 converts 8 at a time with F16C/AVX2): bit for bit what the scalar
// conversions give element by element (half_float_test checks those against
// an independent reference). Where both operands are NaN, which payload the
// sum keeps is the compiler's choice of operand order, so only NaN-ness counts.
TEST(ReduceArrays, SixteenBitFloatsMatchTheScalarConversionsForEveryPattern) {
  struct Kind {
    DType dtype;
    float (*decode)(uint16_t);
    uint16_t (*encode)(float);
  };
  const Kind kinds[] = {{DType::kFloat16, mooncake::half_to_float, mooncake::float_to_half},
                        {DType::kBFloat16, mooncake::bf16_to_float, mooncake::float_to_bf16}};
  const size_t n = 1 << 16;
  std::vector<uint16_t> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<uint16_t>(i);
    b[i] = static_cast<uint16_t>((i * 7919 + 13) & 0xffff);
  }
  for (const Kind& k : kinds) {
    for (RedOp op : {RedOp::kSum, RedOp::kMax, RedOp::kAvg}) {
      std::vector<uint16_t> out(n);
      const void* srcs[2] = {a.data(), b.data()};
      reduce_arrays(k.dtype, op, out.data(), srcs, 2, n, 3);
      size_t wrong = 0, first = n;
      for (size_t i = 0; i < n; ++i) {
        const float x = k.decode(a[i]), y = k.decode(b[i]);
        float r = op == RedOp::kMax ? ((y != y || y > x) ? y : x) : x + y;
        if (op == RedOp::kAvg) r = r / 3.0f;
        const bool both_nan = x != x && y != y;
        const bool same = both_nan ? k.decode(out[i]) != k.decode(out[i]) : out[i] == k.encode(r);
        if (!same && wrong++ == 0) first = i;
      }
      EXPECT_EQ(wrong, 0u) << mooncake::dtype_name(k.dtype) << " " << mooncake::redop_name(op)
                           << ": first at pattern " << first;
    }
  }
}

TEST(ReduceArrays, IntegersWrapAround) {
  EXPECT_EQ(first<int8_t>(reduce(DType::kInt8, RedOp::kSum,
                                 {bytes<int8_t>({127}), bytes<int8_t>({1})}, 1, 2)),
            -128);
  EXPECT_EQ(first<uint8_t>(reduce(DType::kUInt8, RedOp::kSum,
                                  {bytes<uint8_t>({200}), bytes<uint8_t>({100})}, 1, 2)),
            44);
  EXPECT_EQ(first<uint16_t>(reduce(DType::kUInt16, RedOp::kProduct,
                                   {bytes<uint16_t>({65535}), bytes<uint16_t>({65535})}, 1, 2)),
            1);
  EXPECT_EQ(first<int32_t>(reduce(DType::kInt32, RedOp::kProduct,
                                  {bytes<int32_t>({65536}), bytes<int32_t>({65536})}, 1, 2)),
            0);
  EXPECT_EQ(
      first<int64_t>(reduce(
          DType::kInt64, RedOp::kSum,
          {bytes<int64_t>({std::numeric_limits<int64_t>::max()}), bytes<int64_t>({1})}, 1, 2)),
      std::numeric_limits<int64_t>::min());
}

TEST(ReduceArrays, BoolOpsAreLogical) {
  const auto a = bytes<bool>({false, false, true, true}),
             b = bytes<bool>({false, true, false, true});
  auto run = [&](RedOp op) { return reduce(DType::kBool, op, {a, b}, 4, 2); };
  EXPECT_EQ(run(RedOp::kSum), bytes<bool>({false, true, true, true}));
  EXPECT_EQ(run(RedOp::kMax), bytes<bool>({false, true, true, true}));
  EXPECT_EQ(run(RedOp::kBor), bytes<bool>({false, true, true, true}));
  EXPECT_EQ(run(RedOp::kProduct), bytes<bool>({false, false, false, true}));
  EXPECT_EQ(run(RedOp::kMin), bytes<bool>({false, false, false, true}));
  EXPECT_EQ(run(RedOp::kBand), bytes<bool>({false, false, false, true}));
  EXPECT_EQ(run(RedOp::kBxor), bytes<bool>({false, true, true, false}));
}

TEST(ReduceArrays, NaNWinsMinAndMaxWhereverItIs) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (RedOp op : {RedOp::kMin, RedOp::kMax}) {
    for (const auto& srcs : std::vector<std::vector<std::vector<uint8_t>>>{
             {bytes<float>({nan}), bytes<float>({1}), bytes<float>({-1})},
             {bytes<float>({1}), bytes<float>({nan}), bytes<float>({-1})},
             {bytes<float>({1}), bytes<float>({-1}), bytes<float>({nan})}})
      EXPECT_TRUE(std::isnan(first<float>(reduce(DType::kFloat32, op, srcs, 1, 3))))
          << mooncake::redop_name(op);
    const uint16_t hnan = ref_float_to_half(nan);
    EXPECT_TRUE(std::isnan(ref_half_to_float(first<uint16_t>(
        reduce(DType::kFloat16, op, {bytes<uint16_t>({0x3c00}), bytes<uint16_t>({hnan})}, 1, 2)))))
        << "float16 " << mooncake::redop_name(op);
  }
}

TEST(ReduceArrays, AvgDividesTheSumByTheDivisor) {
  const std::vector<std::vector<uint8_t>> srcs = {bytes<double>({1}), bytes<double>({2}),
                                                  bytes<double>({3})};
  EXPECT_EQ(first<double>(reduce(DType::kFloat64, RedOp::kAvg, srcs, 1, 3)), 2.0);
  EXPECT_EQ(first<double>(reduce(DType::kFloat64, RedOp::kAvg, srcs, 1, 4)), 1.5);
}

TEST(ReduceArrays, ZeroElementsTouchNothing) {
  std::vector<uint8_t> out(8, 0xCC);
  const std::vector<uint8_t> src(8, 1);
  const void* srcs[] = {src.data(), src.data()};
  reduce_arrays(DType::kFloat32, RedOp::kSum, out.data(), srcs, 2, 0, 2);
  EXPECT_EQ(out, std::vector<uint8_t>(8, 0xCC));
}

TEST(ReduceArrays, UndefinedPairsAreRefused) {
  std::vector<uint8_t> buf(16);
  const void* srcs[] = {buf.data()};
  for (DType t : all_dtypes()) {
    for (RedOp op : all_ops()) {
      if (mooncake::redop_supported(op, t)) continue;
      EXPECT_TRUE(throws_error(mooncake::ErrorKind::kInvalidArgument,
                               [&] { reduce_arrays(t, op, buf.data(), srcs, 1, 1, 1); }))
          << mooncake::dtype_name(t) << " " << mooncake::redop_name(op);
    }
  }
  size_t refused = all_dtypes().size() * all_ops().size() - supported_pairs().size();
  EXPECT_EQ(refused, 4u * 3 + 9u);  // bitwise on 4 float types, AVG on 9 others
}

}  // namespace
}  // namespace mctest
