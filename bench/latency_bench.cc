// Small-op latency of the bare C++ core: no torch, no Python, no op queue.
// For each world size, that many forked ranks over shared memory run
// back-to-back all_reduce of 2 floats (8 bytes, bench_pg.py's smallest size)
// in timed loops; per loop the slowest rank's mean per op, and the fastest
// loop reported, as bench_pg.py reports a point. It is the "bare core"
// beside which bench_pg.py reads its small ops through torch (it runs this
// binary when built and prints the ratio).
//
//   build/mooncake_latency_bench [world ...]     (default: 2 4 8)
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "core/comm_config.h"
#include "store/store.h"
#include "transport/engine.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWarmup = 200;
constexpr int kOps = 2000;
constexpr int kLoops = 3;  // bench_pg.py's default --repeats

using Means = std::array<double, kLoops>;

// One rank: its mean microseconds per all_reduce in each loop, written to `fd`.
[[noreturn]] void run_rank(const std::string& dir, int rank, int world, int fd) {
  Means means;
  means.fill(-1);
  try {
    mooncake::FileStore store(dir);
    mooncake::TransferEngine engine(mooncake::EngineOptions::from_env());
    mooncake::Communicator comm(engine, store, "latency/", rank, world,
                                mooncake::CommConfig::from_env(30000));
    float v[2] = {1, 0};
    for (int i = 0; i < kWarmup; ++i)
      comm.all_reduce(v, 2, mooncake::DType::kFloat32, mooncake::RedOp::kSum);
    for (double& mean_us : means) {
      comm.barrier();
      const auto t0 = Clock::now();
      for (int i = 0; i < kOps; ++i)
        comm.all_reduce(v, 2, mooncake::DType::kFloat32, mooncake::RedOp::kSum);
      mean_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / kOps;
    }
    comm.barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
  }
  const ssize_t n = write(fd, means.data(), sizeof(means));
  const bool ok = n == sizeof(means) && std::ranges::all_of(means, [](double m) { return m >= 0; });
  _exit(ok ? 0 : 1);
}

// Per loop, the slowest rank's mean; empty when a rank failed.
std::vector<double> run_world(int world) {
  char tmpl[] = "/tmp/mooncake-latency-XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) return {};
  int fds[2];
  if (pipe(fds) != 0) return {};
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      run_rank(dir, r, world, fds[1]);
    }
    if (pid < 0) {  // the ranks already started would wait for this one: stop them
      for (pid_t p : pids) kill(p, SIGKILL);
      for (pid_t p : pids) waitpid(p, nullptr, 0);
      close(fds[0]);
      close(fds[1]);
      std::filesystem::remove_all(dir);
      return {};
    }
    pids.push_back(pid);
  }
  close(fds[1]);
  std::vector<double> slowest(kLoops, 0);
  bool ok = true;
  for (int r = 0; r < world; ++r) {
    Means m;
    // Each rank writes its means in one write of under PIPE_BUF bytes: never interleaved.
    if (read(fds[0], m.data(), sizeof(m)) != sizeof(m)) ok = false;
    for (int i = 0; ok && i < kLoops; ++i) {
      if (m[i] < 0) ok = false;
      slowest[i] = std::max(slowest[i], m[i]);
    }
  }
  close(fds[0]);
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = false;
  }
  std::filesystem::remove_all(dir);
  return ok ? slowest : std::vector<double>{};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> worlds;
  for (int i = 1; i < argc; ++i) worlds.push_back(std::atoi(argv[i]));
  if (worlds.empty()) worlds = {2, 4, 8};
  std::printf(
      "# bare core: all_reduce of 8 bytes (float32) over shm, %d loops of %d ops after %d "
      "warm-up\n",
      kLoops, kOps, kWarmup);
  std::printf("| world | us per op (the fastest loop's slowest rank mean) |\n|---:|---:|\n");
  int failed = 0;
  for (int w : worlds) {
    if (w < 1) {
      std::fprintf(stderr, "world sizes must be >= 1, got %d\n", w);
      return 2;
    }
    const std::vector<double> loops = run_world(w);
    if (loops.empty()) {
      std::printf("| %d | failed |\n", w);
      ++failed;
    } else {
      std::printf("| %d | %.1f |\n", w, *std::ranges::min_element(loops));
      std::fprintf(stderr, "world %d, each loop:", w);
      for (double us : loops) std::fprintf(stderr, " %.1f", us);
      std::fprintf(stderr, "\n");
    }
  }
  return failed ? 1 : 0;
}
