// BF16/FP16 <-> fp32 in registers, and FP8 (e4m3) quantisation in blocks of
// 128 channels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace mooncake::kernels {

// BF16/FP16 pairs to and from fp32 (round to nearest on the way back).
template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using Two = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(Two v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ Two from_floats(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};
template <>
struct Pair<__half> {
  using Two = __half2;
  static __device__ __forceinline__ float2 to_float2(Two v) { return __half22float2(v); }
  static __device__ __forceinline__ Two from_floats(float a, float b) {
    return __floats2half2_rn(a, b);
  }
};

// 8 channels (16 bytes) of T to fp32 and back.
template <typename T>
__device__ __forceinline__ void to_float8(const int4& v, float (&f)[8]) {
  const auto* h = reinterpret_cast<const typename Pair<T>::Two*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = Pair<T>::to_float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ int4 from_float8(const float (&f)[8]) {
  int4 v;
  auto* h = reinterpret_cast<typename Pair<T>::Two*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = Pair<T>::from_floats(f[2 * i], f[2 * i + 1]);
  return v;
}

constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

// FP8 work units: kQuantBlocks 128-channel blocks of a token, quantised by a
// half-warp (8 channels a lane, the blocks' loads all in flight first).
// scale = max(amax, 1e-4) / 448 and data = sat(x * (448 / max(amax, 1e-4))),
// as mooncake.fp8.quantize computes them (IEEE division and multiplication,
// round to nearest), so both paths send the same bytes.
constexpr int kQuantBlocks = 4;

template <typename T>
__device__ __forceinline__ void quantize_blocks(const T* x, uint8_t* data, float* scales,
                                                int64_t first, int64_t blocks, int lane) {
  const int sub = lane % 16;
  const unsigned half = 0xffffu << (lane & 16);
  int4 raw[kQuantBlocks];
#pragma unroll
  for (int b = 0; b < kQuantBlocks; ++b)
    if (first + b < blocks)
      raw[b] = __ldg(reinterpret_cast<const int4*>(x + (first + b) * 128 + sub * 8));
#pragma unroll
  for (int b = 0; b < kQuantBlocks; ++b) {
    if (first + b >= blocks) break;  // the same for the whole half-warp
    float f[8];
    to_float8<T>(raw[b], f);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(half, amax, o));
    amax = fmaxf(amax, kAmaxFloor);
    const float inv = __fdiv_rn(kE4m3Max, amax);
    uint8_t q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      q[i] = __nv_cvt_float_to_fp8(__fmul_rn(f[i], inv), __NV_SATFINITE, __NV_E4M3);
    const int64_t block = first + b;
    *reinterpret_cast<uint2*>(data + block * 128 + sub * 8) = *reinterpret_cast<const uint2*>(q);
    if (sub == 0) scales[block] = __fdiv_rn(amax, kE4m3Max);
  }
}

}  // namespace mooncake::kernels
