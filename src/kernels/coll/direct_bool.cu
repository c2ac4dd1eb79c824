// launch_direct's reductions of bool (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_bool(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<bool>(a, grid, stream);
}

}  // namespace mooncake::kernels
