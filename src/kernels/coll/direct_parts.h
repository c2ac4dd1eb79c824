// launch_direct's kernels, one element type a file (coll/direct_*.cu; float
// and double share one), so that a build compiles them in parallel: in one
// file their 84 instantiations were a cold build's longest step, and in five
// the byte types' file still was (60 s of a 76 s build on the GPU machine).
// Each launches `a` when its dtype is one of the file's, and returns the
// launch's cudaError_t; for another file's dtype it returns kDirectNotMine,
// but for an op the dtype does not define (or no dtype) cudaErrorInvalidValue,
// which is the launch's answer wherever it is asked.
#pragma once

#include "kernels/coll/direct.h"

namespace mooncake::kernels {

constexpr int kDirectNotMine = -1;

int launch_direct_moves(const DirectArgs& a, unsigned grid, CUstream_st* stream);  // any dtype
int launch_direct_half(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_bfloat(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_float(const DirectArgs& a, unsigned grid, CUstream_st* stream);  // and double
int launch_direct_bool(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_uint8(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_int8(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_int16(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_uint16(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_int32(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_uint32(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_int64(const DirectArgs& a, unsigned grid, CUstream_st* stream);
int launch_direct_uint64(const DirectArgs& a, unsigned grid, CUstream_st* stream);

}  // namespace mooncake::kernels
