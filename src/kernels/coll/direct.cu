// launch_direct (coll/direct.h). The kernel is coll/direct_kernel.cuh's; its
// instantiations lie in coll/direct_*.cu, one element type a file
// (direct_parts.h).
#include <cuda_runtime.h>

#include <initializer_list>

#include "kernels/coll/direct.h"
#include "kernels/coll/direct_parts.h"

namespace mooncake::kernels {

int launch_direct(const DirectArgs& a, int blocks, CUstream_st* stream) {
  if (blocks < 1 || blocks > (a.mapped ? kDirectMaxMappedBlocks : kDirectMaxBlocks))
    return static_cast<int>(cudaErrorInvalidValue);
  const auto grid = static_cast<unsigned>(blocks);
  if (!direct_reduces(a.kind)) return launch_direct_moves(a, grid, stream);
  for (auto* part :
       {launch_direct_half, launch_direct_bfloat, launch_direct_float, launch_direct_bool,
        launch_direct_uint8, launch_direct_int8, launch_direct_int16, launch_direct_uint16,
        launch_direct_int32, launch_direct_uint32, launch_direct_int64, launch_direct_uint64}) {
    const int err = part(a, grid, stream);
    if (err != kDirectNotMine) return err;
  }
  return static_cast<int>(cudaErrorInvalidValue);  // (not reached: the first answers it)
}

}  // namespace mooncake::kernels
