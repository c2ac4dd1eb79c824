// launch_direct's reductions of float32 and float64 (direct_parts.h).
#include "kernels/coll/direct_kernel.cuh"

namespace mooncake::kernels {

int launch_direct_float(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return launch_reductions<float, double>(a, grid, stream);
}

}  // namespace mooncake::kernels
