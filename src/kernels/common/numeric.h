// The element arithmetic of a reduction, one definition for the host's
// reduce_arrays (collectives/reduce.cc, plain C++) and the CUDA backend's
// kernel (kernels/coll/reduce.cu), so that both paths give bit-identical
// results: float16/bfloat16 <-> float conversions, how an element type is
// loaded into and stored from its accumulator, and one step of each op.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#include "core/dtype.h"
#include "core/hd.h"

namespace mooncake {

// The bits of a float and back: the device's intrinsics there, std::bit_cast
// on the host.
MC_HD inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<uint32_t>(f);
#endif
}

MC_HD inline float float_of_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

// float16 <-> float, round to nearest even. Each side converts its own way
// (the host through _Float16, the device with the __half intrinsics); both
// are IEEE binary16 conversions, so they give the same bits.
MC_HD inline float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  return static_cast<float>(std::bit_cast<_Float16>(h));
#endif
}

MC_HD inline uint16_t float_to_half(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  return std::bit_cast<uint16_t>(static_cast<_Float16>(f));
#endif
}

// bfloat16 is the high half of a float.
MC_HD inline float bf16_to_float(uint16_t b) {
  return float_of_bits(static_cast<uint32_t>(b) << 16);
}

// Round to nearest even; a NaN stays a (quiet) NaN (f != f only for NaN: no
// -ffast-math here).
MC_HD inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if (f != f) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// float16 and bfloat16 elements, as the reductions see them: 16 bits.
struct Half {
  uint16_t bits;
};
struct BFloat {
  uint16_t bits;
};

// How an element type is loaded into and stored from its accumulator type.
template <typename T>
struct Acc {
  using type = T;
  MC_HD static T load(T v) { return v; }
  MC_HD static T store(T v) { return v; }
};
template <>
struct Acc<Half> {
  using type = float;
  MC_HD static float load(Half v) { return half_to_float(v.bits); }
  MC_HD static Half store(float v) { return Half{float_to_half(v)}; }
};
template <>
struct Acc<BFloat> {
  using type = float;
  MC_HD static float load(BFloat v) { return bf16_to_float(v.bits); }
  MC_HD static BFloat store(float v) { return BFloat{float_to_bf16(v)}; }
};

// `a` op `b` on accumulators. The op is a template argument so that loops
// over elements have no branch per element. Floating MIN and MAX propagate
// NaN (b != b only for NaN); integers wrap around, as torch's do.
template <RedOp Op, typename A>
MC_HD inline A combine(A a, A b) {
  if constexpr (std::is_same_v<A, bool>) {
    if constexpr (Op == RedOp::kSum || Op == RedOp::kMax || Op == RedOp::kBor) return a || b;
    if constexpr (Op == RedOp::kProduct || Op == RedOp::kMin || Op == RedOp::kBand) return a && b;
    if constexpr (Op == RedOp::kBxor) return a != b;
    return a;
  } else if constexpr (std::is_floating_point_v<A>) {
    if constexpr (Op == RedOp::kSum || Op == RedOp::kAvg) return a + b;
    if constexpr (Op == RedOp::kProduct) return a * b;
    if constexpr (Op == RedOp::kMin) return (b != b || b < a) ? b : a;
    if constexpr (Op == RedOp::kMax) return (b != b || b > a) ? b : a;
    return a;
  } else {
    // In an unsigned type at least as wide as int, so that narrow types are
    // not promoted to (signed) int.
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    if constexpr (Op == RedOp::kSum) return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
    if constexpr (Op == RedOp::kProduct)
      return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
    if constexpr (Op == RedOp::kMin) return b < a ? b : a;
    if constexpr (Op == RedOp::kMax) return b > a ? b : a;
    if constexpr (Op == RedOp::kBand) return a & b;
    if constexpr (Op == RedOp::kBor) return a | b;
    if constexpr (Op == RedOp::kBxor) return a ^ b;
    return a;
  }
}

}  // namespace mooncake
