// launch_direct's reductions of uint32 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_uint32(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<uint32_t>(a, grid, stream);
}

}  // namespace mooncake::kernels
