// launch_direct's kernels, a few element types a file (coll/direct_*.cu),
// so that a build compiles them in parallel: in one file their 84
// instantiations were a cold build's longest step. Each launches `a` when its
// dtype is one of the file's, and returns the launch's cudaError_t; for
// another file's dtype it returns kDirectNotMine, but for an op the dtype
// does not define (or no dtype) cudaErrorInvalidValue, which is the launch's
// answer wherever it is asked.
#pragma once

#include "kernels/coll/direct.h"

namespace mooncake::kernels {

constexpr int kDirectNotMine = -1;

int launch_direct_moves(const DirectArgs& a, unsigned grid, CUstream_st* stream);  // any dtype
int launch_direct_half(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_float(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_int8(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_int16(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_int64(const DirectArgs& a, unsigned grid, CUstream_st* stream);

}  // namespace mooncake::kernels
