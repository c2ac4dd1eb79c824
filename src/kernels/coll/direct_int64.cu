// launch_direct's reductions of uint32, int64 and uint64 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_int64(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<uint32_t, int64_t, uint64_t>(a, grid, stream);
}

}  // namespace mooncake::kernels
