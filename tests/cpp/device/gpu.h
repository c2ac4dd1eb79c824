// GPU gating for the device library's tests: whether this machine has a GPU,
// asked in a child process (a process that has touched CUDA cannot hand it
// to the ranks it forks), and the pieces every multi-process GPU test needs.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "collectives/communicator.h"
#include "core/comm_config.h"
#include "harness.h"
#include "transport/engine.h"

namespace mctest {

// The number of GPUs this process's children may use (0: none, or no driver).
int gpu_count();

// Skips the test where there is no GPU. `make gpu-check` fails a run in which
// any test of this binary skipped, so a GPU machine never passes by skipping.
#define MC_REQUIRE_GPU()                                      \
  do {                                                        \
    if (::mctest::gpu_count() == 0) GTEST_SKIP() << "no GPU"; \
  } while (0)

// A rank on GPU rank % gpus (the current device afterwards): its transfer
// engine and Communicator on the run's store, and a stream of its own.
struct GpuRank {
  explicit GpuRank(Rank& r, int64_t timeout_ms = 10000);
  ~GpuRank();
  GpuRank(const GpuRank&) = delete;
  GpuRank& operator=(const GpuRank&) = delete;
  int device = 0;
  mooncake::TransferEngine engine;
  mooncake::Communicator comm;
  cudaStream_t stream = nullptr;
};

}  // namespace mctest
