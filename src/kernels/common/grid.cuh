// A barrier across the blocks of one launch (every block resident at once).
#pragma once

#include <cstdint>

#include "kernels/api.h"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"

namespace mooncake::kernels {

// A grid barrier in two halves, so that a block does other work between
// arriving and waiting. sync[0] counts arrivals, sync[1] is the generation:
// the last block to arrive resets the count and advances the generation,
// which the others wait for (the words return to a reusable state every
// time, so graph replays work). Called by one thread, after a __syncthreads.
__device__ __forceinline__ uint32_t grid_arrive(uint32_t* sync) {
  const uint32_t gen = *reinterpret_cast<volatile uint32_t*>(sync + 1);
  __threadfence();  // the block's stores (made visible to this thread by the barrier) first
  if (atomicAdd(sync, 1) == gridDim.x - 1) {
    *reinterpret_cast<volatile uint32_t*>(sync) = 0;
    __threadfence();
    atomicAdd(sync + 1, 1);
  }
  return gen;
}

// Waits for the generation after `gen`; past the deadline (blocks of the
// launch were not all resident: a GPU shared with other work) it reports and
// goes on, as the other waits do.
__device__ inline void grid_wait(uint32_t* sync, uint32_t gen, int64_t timeout_ns,
                                 int32_t* status) {
  const uint64_t deadline = now_ns() + static_cast<uint64_t>(timeout_ns);
  while (*reinterpret_cast<volatile uint32_t*>(sync + 1) == gen) {
    if (now_ns() > deadline) {
      report(status, kStatusNotResident,
             static_cast<int>(*reinterpret_cast<volatile uint32_t*>(sync)),
             static_cast<int>(gridDim.x));
      return;
    }
    __nanosleep(64);
  }
  __threadfence();  // the other blocks' writes, before this block reads them
}

}  // namespace mooncake::kernels
