// One element, or one 16-byte vector of elements, reduced from several
// sources: the arithmetic every reduction kernel of the CUDA backend shares
// (coll/reduce.cu, coll/direct_kernel.cuh), so that their results are the same
// bits, and the host's (collectives/reduce.cc, through common/numeric.h).
// Sources are combined in order, the first loaded as the accumulator; AVG
// divides the sum once, at the end.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/common/numeric.h"

namespace mooncake::kernels {

// `src(s)` is source s's element array (const T*), for s in [0, n), n >= 1.
template <typename T, RedOp Op, typename Src>
__device__ __forceinline__ T reduce_element(Src src, int n, size_t i, int avg_divisor) {
  using A = typename Acc<T>::type;
  A acc = Acc<T>::load(src(0)[i]);
  for (int s = 1; s < n; ++s) acc = combine<Op, A>(acc, Acc<T>::load(src(s)[i]));
  if constexpr (std::is_floating_point_v<A> && Op == RedOp::kAvg)
    acc = acc / static_cast<A>(avg_divisor);  // IEEE division (nvcc's default)
  return Acc<T>::store(acc);
}

// Vector i (16 bytes) of every source, `vsrc(s)` being source s's array of
// vectors: each element combined exactly as reduce_element does.
template <typename T, RedOp Op, typename VSrc>
__device__ __forceinline__ uint4 reduce_vector(VSrc vsrc, int n, size_t i, int avg_divisor) {
  using A = typename Acc<T>::type;
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  A acc[V];
  uint4 v = vsrc(0)[i];
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (size_t k = 0; k < V; ++k) acc[k] = Acc<T>::load(e[k]);
  for (int s = 1; s < n; ++s) {
    v = vsrc(s)[i];
#pragma unroll
    for (size_t k = 0; k < V; ++k) acc[k] = combine<Op, A>(acc[k], Acc<T>::load(e[k]));
  }
  uint4 o;
  T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
  for (size_t k = 0; k < V; ++k) {
    if constexpr (std::is_floating_point_v<A> && Op == RedOp::kAvg)
      acc[k] = acc[k] / static_cast<A>(avg_divisor);
    oe[k] = Acc<T>::store(acc[k]);
  }
  return o;
}

// kN vectors at once, i + u * step for u in [0, kN), each as reduce_vector
// reduces it (the same bits): every source's kN loads are issued before any of
// them is used, so that a thread has kN loads in flight, not one.
template <typename T, RedOp Op, int kN, typename VSrc>
__device__ __forceinline__ void reduce_vectors(VSrc vsrc, int n, size_t i, size_t step,
                                               int avg_divisor, uint4 (&out)[kN]) {
  using A = typename Acc<T>::type;
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  A acc[kN][V];
  uint4 v[kN];
#pragma unroll
  for (int u = 0; u < kN; ++u) v[u] = vsrc(0)[i + u * step];
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
    for (size_t k = 0; k < V; ++k) acc[u][k] = Acc<T>::load(e[k]);
  }
  for (int s = 1; s < n; ++s) {
#pragma unroll
    for (int u = 0; u < kN; ++u) v[u] = vsrc(s)[i + u * step];
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
      for (size_t k = 0; k < V; ++k) acc[u][k] = combine<Op, A>(acc[u][k], Acc<T>::load(e[k]));
    }
  }
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    T* oe = reinterpret_cast<T*>(&out[u]);
#pragma unroll
    for (size_t k = 0; k < V; ++k) {
      if constexpr (std::is_floating_point_v<A> && Op == RedOp::kAvg)
        acc[u][k] = acc[u][k] / static_cast<A>(avg_divisor);
      oe[k] = Acc<T>::store(acc[u][k]);
    }
  }
}

// Calls `f.template operator()<T, Op>()` for the element type of `dtype` and
// `op`, for the pairs a reduction defines (redop_supported: AVG on floating
// types only, the bitwise ops on the others); returns cudaErrorInvalidValue
// for any other (the host checks redop_supported first).
template <typename T, typename F>
int with_op(RedOp op, F&& f) {
  constexpr bool floating = std::is_floating_point_v<typename Acc<T>::type>;
  switch (op) {
    case RedOp::kSum: return f.template operator()<T, RedOp::kSum>();
    case RedOp::kProduct: return f.template operator()<T, RedOp::kProduct>();
    case RedOp::kMin: return f.template operator()<T, RedOp::kMin>();
    case RedOp::kMax: return f.template operator()<T, RedOp::kMax>();
    default: break;
  }
  if constexpr (floating) {
    if (op == RedOp::kAvg) return f.template operator()<T, RedOp::kAvg>();
  } else {
    if (op == RedOp::kBand) return f.template operator()<T, RedOp::kBand>();
    if (op == RedOp::kBor) return f.template operator()<T, RedOp::kBor>();
    if (op == RedOp::kBxor) return f.template operator()<T, RedOp::kBxor>();
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template <typename F>
int with_dtype_op(DType dtype, RedOp op, F&& f) {
  switch (dtype) {
    case DType::kBool: return with_op<bool>(op, f);
    case DType::kUInt8: return with_op<uint8_t>(op, f);
    case DType::kInt8: return with_op<int8_t>(op, f);
    case DType::kInt16: return with_op<int16_t>(op, f);
    case DType::kInt32: return with_op<int32_t>(op, f);
    case DType::kInt64: return with_op<int64_t>(op, f);
    case DType::kUInt16: return with_op<uint16_t>(op, f);
    case DType::kUInt32: return with_op<uint32_t>(op, f);
    case DType::kUInt64: return with_op<uint64_t>(op, f);
    case DType::kFloat16: return with_op<Half>(op, f);
    case DType::kBFloat16: return with_op<BFloat>(op, f);
    case DType::kFloat32: return with_op<float>(op, f);
    case DType::kFloat64: return with_op<double>(op, f);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace mooncake::kernels
