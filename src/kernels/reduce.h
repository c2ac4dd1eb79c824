// The CUDA backend's reduction kernel: out = sources combined in order, with
// the same arithmetic as the host's reduce_arrays (collectives/reduce.h): fp16
// and bf16 accumulate in fp32 and are rounded once, integers wrap around, MIN
// and MAX propagate NaN, AVG divides the sum once. So the device plane and
// the host path give bit-identical results, and so does every rank (each
// reduces the same sources in the same order). Torch-free.
#pragma once

#include <cstddef>

#include "core/dtype.h"

struct CUstream_st;

namespace mooncake::kernels {

constexpr int kMaxReduceSources = 64;

struct ReduceArgs {
  const void* srcs[kMaxReduceSources];  // nsrc device pointers (this rank's or mapped)
  int nsrc = 0;
  void* out = nullptr;  // may be one of srcs
  size_t count = 0;     // elements
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int avg_divisor = 1;
};

// Queues the reduction on `stream`; returns the launch's cudaError_t (0: queued).
int launch_reduce(const ReduceArgs& args, CUstream_st* stream);

}  // namespace mooncake::kernels
