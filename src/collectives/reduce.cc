#include "collectives/reduce.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/error.h"
#include "kernels/common/numeric.h"

namespace mooncake {

namespace {

constexpr size_t kBlock = 2048;

// The reduction in blocks: inlined into each variant below, so that it is
// compiled for that variant's instruction set.
template <typename T, RedOp Op>
__attribute__((always_inline)) inline void reduce_loop(void* out_v, const void* const* srcs_v,
                                                       int nsrc, size_t count, int avg_divisor) {
  using A = typename Acc<T>::type;
  T* out = static_cast<T*>(out_v);
  constexpr bool kDivide = std::is_floating_point_v<A> && Op == RedOp::kAvg;
  if constexpr (std::is_same_v<A, T>) {
    // No conversion: each pass reads its source straight from memory, and the
    // last one writes the output, so every byte goes through DRAM once (an
    // accumulator block stays in L1 between the passes).
    const T* const* srcs = reinterpret_cast<const T* const*>(srcs_v);
    if (nsrc == 1 && !kDivide) {
      if (out != srcs[0]) std::memmove(out, srcs[0], count * sizeof(T));
      return;
    }
    A acc[kBlock];
    for (size_t base = 0; base < count; base += kBlock) {
      const size_t n = count - base < kBlock ? count - base : kBlock;
      // s0 op s1 op ... in rank order: s0 itself, then acc; the last source
      // is combined on the way out.
      const T* prev = srcs[0] + base;
      for (int s = 1; s + 1 < nsrc; ++s, prev = acc) {
        const T* c = srcs[s] + base;
        for (size_t i = 0; i < n; ++i) acc[i] = combine<Op, A>(prev[i], c[i]);
      }
      T* o = out + base;
      if (nsrc == 1) {
        if constexpr (kDivide)  // AVG over one source
          for (size_t i = 0; i < n; ++i) o[i] = prev[i] / static_cast<A>(avg_divisor);
      } else if (const T* last = srcs[nsrc - 1] + base; kDivide) {
        for (size_t i = 0; i < n; ++i)
          o[i] = combine<Op, A>(prev[i], last[i]) / static_cast<A>(avg_divisor);
      } else {
        for (size_t i = 0; i < n; ++i) o[i] = combine<Op, A>(prev[i], last[i]);
      }
    }
  } else {
    A acc[kBlock], next[kBlock];
    for (size_t base = 0; base < count; base += kBlock) {
      const size_t n = count - base < kBlock ? count - base : kBlock;
      const T* first = static_cast<const T*>(srcs_v[0]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] = Acc<T>::load(first[i]);
      for (int s = 1; s < nsrc; ++s) {
        const T* c = static_cast<const T*>(srcs_v[s]) + base;
        for (size_t i = 0; i < n; ++i) next[i] = Acc<T>::load(c[i]);
        for (size_t i = 0; i < n; ++i) acc[i] = combine<Op, A>(acc[i], next[i]);
      }
      if constexpr (kDivide)
        for (size_t i = 0; i < n; ++i) acc[i] = acc[i] / static_cast<A>(avg_divisor);
      for (size_t i = 0; i < n; ++i) out[base + i] = Acc<T>::store(acc[i]);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define MC_AVX2_PATH 1
// On x86 with AVX2 and F16C, every dtype's loop is compiled for AVX2, and
// float16 and bfloat16 convert 8 elements per instruction (round to nearest
// even, NaN kept a NaN with its payload: what the scalar conversions do, bit
// for bit; bfloat16's conversions are shifts, which the compiler vectorizes
// here). No FMA: a sum stays a sum, bit-equal to the SSE2 path and the CUDA
// kernel. Everything in this region only runs where the CPU has those
// instructions (cpu_has_avx2).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif
// 8 float16/bfloat16 values to floats and back.
template <typename T>
inline __m256 load8(const T* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<T, Half>)
    return _mm256_cvtph_ps(h);
  else  // bfloat16: the high half of a float
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename T>
inline void store8(__m256 v, T* out) {
  __m128i h;
  if constexpr (std::is_same_v<T, Half>) {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  } else {  // bfloat16: float_to_bf16, 8 at a time
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
    // 32-bit lanes (each < 2^16) to 16 bits, in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
    h = _mm256_castsi256_si128(packed);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
}

// combine<Op, float> on 8 lanes, the same comparisons lane by lane.
template <RedOp Op>
inline __m256 combine8(__m256 a, __m256 b) {
  if constexpr (Op == RedOp::kSum || Op == RedOp::kAvg) return _mm256_add_ps(a, b);
  if constexpr (Op == RedOp::kProduct) return _mm256_mul_ps(a, b);
  if constexpr (Op == RedOp::kMin || Op == RedOp::kMax) {
    const __m256 better =
        Op == RedOp::kMin ? _mm256_cmp_ps(b, a, _CMP_LT_OQ) : _mm256_cmp_ps(b, a, _CMP_GT_OQ);
    return _mm256_blendv_ps(a, b, _mm256_or_ps(_mm256_cmp_ps(b, b, _CMP_UNORD_Q), better));
  }
  return a;  // bitwise ops: not defined for floats (refused before)
}

// float16/bfloat16: every source converted and combined in registers, 16
// elements at a time, and rounded once on the way out; the memory traffic is
// the sources read once and the output written once.
template <typename T, RedOp Op>
void reduce_half_avx2(void* out_v, const void* const* srcs_v, int nsrc, size_t count,
                      int avg_divisor) {
  T* out = static_cast<T*>(out_v);
  const T* const* srcs = reinterpret_cast<const T* const*>(srcs_v);
  const __m256 divisor = _mm256_set1_ps(static_cast<float>(avg_divisor));
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m256 lo = load8(srcs[0] + i), hi = load8(srcs[0] + i + 8);
    for (int s = 1; s < nsrc; ++s) {
      lo = combine8<Op>(lo, load8(srcs[s] + i));
      hi = combine8<Op>(hi, load8(srcs[s] + i + 8));
    }
    if constexpr (Op == RedOp::kAvg) {
      lo = _mm256_div_ps(lo, divisor);
      hi = _mm256_div_ps(hi, divisor);
    }
    store8(lo, out + i);
    store8(hi, out + i + 8);
  }
  for (; i < count; ++i) {  // the last few, one at a time alike
    float v = Acc<T>::load(srcs[0][i]);
    for (int s = 1; s < nsrc; ++s) v = combine<Op, float>(v, Acc<T>::load(srcs[s][i]));
    if constexpr (Op == RedOp::kAvg) v = v / static_cast<float>(avg_divisor);
    out[i] = Acc<T>::store(v);
  }
}

// reduce_loop, instantiated in this region so that it is compiled for AVX2
// (every dtype: 8 floats or 32 bytes per instruction instead of SSE2's 4 / 16).
template <typename T, RedOp Op>
void reduce_typed_op_avx2(void* out, const void* const* srcs, int nsrc, size_t count,
                          int avg_divisor) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat>)
    reduce_half_avx2<T, Op>(out, srcs, nsrc, count, avg_divisor);
  else
    reduce_loop<T, Op>(out, srcs, nsrc, count, avg_divisor);
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return yes;
}
#endif

template <typename T, RedOp Op>
void reduce_typed_op(void* out, const void* const* srcs, int nsrc, size_t count, int avg_divisor) {
#ifdef MC_AVX2_PATH
  if (cpu_has_avx2()) return reduce_typed_op_avx2<T, Op>(out, srcs, nsrc, count, avg_divisor);
#endif
  reduce_loop<T, Op>(out, srcs, nsrc, count, avg_divisor);
}

template <typename T>
void reduce_typed(RedOp op, void* out, const void* const* srcs, int nsrc, size_t count,
                  int avg_divisor) {
  switch (op) {
    case RedOp::kSum: return reduce_typed_op<T, RedOp::kSum>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kProduct:
      return reduce_typed_op<T, RedOp::kProduct>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kMin: return reduce_typed_op<T, RedOp::kMin>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kMax: return reduce_typed_op<T, RedOp::kMax>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kAvg: return reduce_typed_op<T, RedOp::kAvg>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kBand: return reduce_typed_op<T, RedOp::kBand>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kBor: return reduce_typed_op<T, RedOp::kBor>(out, srcs, nsrc, count, avg_divisor);
    case RedOp::kBxor: return reduce_typed_op<T, RedOp::kBxor>(out, srcs, nsrc, count, avg_divisor);
    default: MC_ASSERT(false, "unknown reduce op");
  }
}

}  // namespace

void reduce_arrays(DType dtype, RedOp op, void* out, const void* const* srcs, int nsrc,
                   size_t count, int avg_divisor) {
  MC_CHECK_ARG(redop_supported(op, dtype), "reduce op ", redop_name(op),
               " is not supported for dtype ", dtype_name(dtype));
  MC_ASSERT(nsrc >= 1);
  if (count == 0) return;
  switch (dtype) {
    case DType::kBool: return reduce_typed<bool>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kUInt8: return reduce_typed<uint8_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kInt8: return reduce_typed<int8_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kInt16: return reduce_typed<int16_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kInt32: return reduce_typed<int32_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kInt64: return reduce_typed<int64_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kUInt16: return reduce_typed<uint16_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kUInt32: return reduce_typed<uint32_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kUInt64: return reduce_typed<uint64_t>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kFloat16: return reduce_typed<Half>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kBFloat16: return reduce_typed<BFloat>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kFloat32: return reduce_typed<float>(op, out, srcs, nsrc, count, avg_divisor);
    case DType::kFloat64: return reduce_typed<double>(op, out, srcs, nsrc, count, avg_divisor);
    default: MC_ASSERT(false, "unknown dtype");
  }
}

}  // namespace mooncake
