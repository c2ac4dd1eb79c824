// launch_reduce (kernels/api.h): grid-stride, 16 bytes per load where
// aligned; the element arithmetic is coll/reduce.cuh's, which the
// device-driven all_reduce shares (and the host's reduce_arrays, through
// common/numeric.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/api.h"
#include "kernels/coll/reduce.cuh"

namespace mooncake::kernels {
namespace {

// With `vec` (every pointer 16-byte aligned), 16 bytes per load: the
// elements of one load are combined one by one, exactly as one at a time.
template <typename T, RedOp Op>
__global__ void reduce_kernel(ReduceArgs args, bool vec) {
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (vec) {
    const size_t nvec = args.count / V;
    auto vsrc = [&](int s) { return static_cast<const uint4*>(args.srcs[s]); };
    for (size_t i = tid; i < nvec; i += stride)
      static_cast<uint4*>(args.out)[i] = reduce_vector<T, Op>(vsrc, args.nsrc, i, args.avg_divisor);
    done = nvec * V;
  }
  auto src = [&](int s) { return static_cast<const T*>(args.srcs[s]); };
  for (size_t i = done + tid; i < args.count; i += stride)
    static_cast<T*>(args.out)[i] = reduce_element<T, Op>(src, args.nsrc, i, args.avg_divisor);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace

int launch_reduce(const ReduceArgs& a, CUstream_st* stream) {
  if (a.count == 0) return 0;
  if (a.nsrc < 1 || a.nsrc > kMaxReduceSources) return static_cast<int>(cudaErrorInvalidValue);
  bool vec = aligned16(a.out);
  for (int s = 0; s < a.nsrc; ++s) vec = vec && aligned16(a.srcs[s]);
  return with_dtype_op(a.dtype, a.op, [&]<typename T, RedOp Op>() {
    constexpr int kThreads = 256;
    const size_t work = vec ? a.count / (sizeof(uint4) / sizeof(T)) + 1 : a.count;
    size_t blocks = (work + kThreads - 1) / kThreads;
    if (blocks > 2048) blocks = 2048;
    reduce_kernel<T, Op><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, vec);
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace mooncake::kernels
