// launch_direct's reductions of int16, uint16 and int32 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_int16(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<int16_t, uint16_t, int32_t>(a, grid, stream);
}

}  // namespace mooncake::kernels
