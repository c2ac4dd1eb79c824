// launch_direct's reductions of bfloat16 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_bfloat(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<BFloat>(a, grid, stream);
}

}  // namespace mooncake::kernels
