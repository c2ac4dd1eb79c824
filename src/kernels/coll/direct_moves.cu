// launch_direct's kinds that only move data: one instantiation, on bytes,
// for every dtype (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_moves(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  direct_op<uint8_t, RedOp::kSum, true><<<grid, kDirectThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace mooncake::kernels
