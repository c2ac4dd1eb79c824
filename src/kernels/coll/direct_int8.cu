// launch_direct's reductions of int8 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_int8(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<int8_t>(a, grid, stream);
}

}  // namespace mooncake::kernels
