#include "gpu.h"

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include "device/cuda.h"

namespace mctest {

int gpu_count() {
  static const int count = [] {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      int n = 0;
      if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
      ::_exit(n > 100 ? 100 : n);
    }
    int status = 0;
    if (pid < 0 || ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
    return WEXITSTATUS(status);
  }();
  return count;
}

namespace {

int pick_device(int rank) {
  int n = 0;
  mooncake::cuda_check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  const int device = rank % n;
  mooncake::cuda_check(cudaSetDevice(device), "cudaSetDevice");
  return device;
}

}  // namespace

GpuRank::GpuRank(Rank& r, int64_t timeout_ms)
    : device(pick_device(r.rank)),
      engine(mooncake::EngineOptions::from_env()),
      comm(engine, r.store, "t/", r.rank, r.size, mooncake::CommConfig::from_env(timeout_ms)) {
  mooncake::cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
}

GpuRank::~GpuRank() {
  cudaStreamDestroy(stream);
}

}  // namespace mctest
