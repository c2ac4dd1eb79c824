// launch_direct's reductions of int32 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_int32(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<int32_t>(a, grid, stream);
}

}  // namespace mooncake::kernels
