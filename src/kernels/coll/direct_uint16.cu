// launch_direct's reductions of uint16 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_uint16(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<uint16_t>(a, grid, stream);
}

}  // namespace mooncake::kernels
