// launch_reduce (kernels/api.h): grid-stride, 16 bytes per load where
// aligned; the element arithmetic is collectives/reduce.cc's, from the same
// header (common/numeric.h).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/api.h"
#include "kernels/common/numeric.h"

namespace mooncake::kernels {
namespace {

template <typename T, RedOp Op>
__device__ void reduce_one(const ReduceArgs& args, size_t i) {
  using A = typename Acc<T>::type;
  A acc = Acc<T>::load(static_cast<const T*>(args.srcs[0])[i]);
  for (int s = 1; s < args.nsrc; ++s)
    acc = combine<Op, A>(acc, Acc<T>::load(static_cast<const T*>(args.srcs[s])[i]));
  if constexpr (std::is_floating_point_v<A> && Op == RedOp::kAvg)
    acc = acc / static_cast<A>(args.avg_divisor);  // IEEE division (nvcc's default)
  static_cast<T*>(args.out)[i] = Acc<T>::store(acc);
}

// With `vec` (every pointer 16-byte aligned), 16 bytes per load: the
// elements of one load are combined one by one, exactly as reduce_one does.
template <typename T, RedOp Op>
__global__ void reduce_kernel(ReduceArgs args, bool vec) {
  using A = typename Acc<T>::type;
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (vec) {
    const size_t nvec = args.count / V;
    for (size_t i = tid; i < nvec; i += stride) {
      A acc[V];
      uint4 v = static_cast<const uint4*>(args.srcs[0])[i];
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (size_t k = 0; k < V; ++k) acc[k] = Acc<T>::load(e[k]);
      for (int s = 1; s < args.nsrc; ++s) {
        v = static_cast<const uint4*>(args.srcs[s])[i];
#pragma unroll
        for (size_t k = 0; k < V; ++k) acc[k] = combine<Op, A>(acc[k], Acc<T>::load(e[k]));
      }
      uint4 o;
      T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
      for (size_t k = 0; k < V; ++k) {
        if constexpr (std::is_floating_point_v<A> && Op == RedOp::kAvg)
          acc[k] = acc[k] / static_cast<A>(args.avg_divisor);
        oe[k] = Acc<T>::store(acc[k]);
      }
      static_cast<uint4*>(args.out)[i] = o;
    }
    done = nvec * V;
  }
  for (size_t i = done + tid; i < args.count; i += stride) reduce_one<T, Op>(args, i);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

template <typename T, RedOp Op>
int launch_typed_op(const ReduceArgs& a, cudaStream_t stream) {
  constexpr int kThreads = 256;
  bool vec = aligned16(a.out);
  for (int s = 0; s < a.nsrc; ++s) vec = vec && aligned16(a.srcs[s]);
  const size_t work = vec ? a.count / (sizeof(uint4) / sizeof(T)) + 1 : a.count;
  size_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > 2048) blocks = 2048;
  reduce_kernel<T, Op><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, vec);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_typed(const ReduceArgs& a, cudaStream_t s) {
  switch (a.op) {
    case RedOp::kSum: return launch_typed_op<T, RedOp::kSum>(a, s);
    case RedOp::kProduct: return launch_typed_op<T, RedOp::kProduct>(a, s);
    case RedOp::kMin: return launch_typed_op<T, RedOp::kMin>(a, s);
    case RedOp::kMax: return launch_typed_op<T, RedOp::kMax>(a, s);
    case RedOp::kAvg: return launch_typed_op<T, RedOp::kAvg>(a, s);
    case RedOp::kBand: return launch_typed_op<T, RedOp::kBand>(a, s);
    case RedOp::kBor: return launch_typed_op<T, RedOp::kBor>(a, s);
    case RedOp::kBxor: return launch_typed_op<T, RedOp::kBxor>(a, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

int launch_reduce(const ReduceArgs& a, CUstream_st* stream) {
  if (a.count == 0) return 0;
  if (a.nsrc < 1 || a.nsrc > kMaxReduceSources) return static_cast<int>(cudaErrorInvalidValue);
  switch (a.dtype) {
    case DType::kBool: return launch_typed<bool>(a, stream);
    case DType::kUInt8: return launch_typed<uint8_t>(a, stream);
    case DType::kInt8: return launch_typed<int8_t>(a, stream);
    case DType::kInt16: return launch_typed<int16_t>(a, stream);
    case DType::kInt32: return launch_typed<int32_t>(a, stream);
    case DType::kInt64: return launch_typed<int64_t>(a, stream);
    case DType::kUInt16: return launch_typed<uint16_t>(a, stream);
    case DType::kUInt32: return launch_typed<uint32_t>(a, stream);
    case DType::kUInt64: return launch_typed<uint64_t>(a, stream);
    case DType::kFloat16: return launch_typed<Half>(a, stream);
    case DType::kBFloat16: return launch_typed<BFloat>(a, stream);
    case DType::kFloat32: return launch_typed<float>(a, stream);
    case DType::kFloat64: return launch_typed<double>(a, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace mooncake::kernels
