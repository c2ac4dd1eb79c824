// launch_direct's reductions of float16 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_half(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<Half>(a, grid, stream);
}

}  // namespace mooncake::kernels
