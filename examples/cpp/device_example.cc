// mooncake without torch: collectives and expert-parallel dispatch/combine on
// the GPU among processes of one host, through the C++ API of mooncake_core
// (membership, failure detection, agreement) and mooncake_cuda (device
// collectives, the EP buffer). Then one rank is killed, and the survivors go
// on: their next all_reduce covers them alone, and their next dispatch and
// combine leave the dead rank's experts out.
//
//   build/mooncake_device_example [ranks]      (default 3; ranks share GPU 0
//                                               unless the host has more)
//
// Several processes on one GPU run their kernels side by side only under MPS
// (nvidia-cuda-mps-control -d); without it they take turns: still correct,
// slower. Exits 0 when every check passed.
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/reduce.h"
#include "core/comm_config.h"
#include "device/collectives.h"
#include "device/ep.h"
#include "store/store.h"
#include "transport/engine.h"

namespace {

using namespace mooncake;

// EP shape: T tokens of H channels per rank, each to K of E experts.
constexpr int64_t kT = 32, kH = 256, kK = 2, kExpertsPerRank = 4;
constexpr float kWeights[kK] = {0.5f, 0.25f};  // exact in bf16

// Token t of `rank`: every channel holds a small integer (exact in bf16 after
// the weights), and it selects experts t + rank + k * (E / K) (mod E).
float token_value(int rank, int64_t t) {
  return static_cast<float>((rank * kT + t) % 64 + 1);
}
int64_t expert_of(int rank, int64_t t, int k, int64_t E) {
  return (t + rank + k * (E / kK)) % E;
}

int failures = 0;
void expect(bool ok, int rank, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  }
}

// One dispatch and combine with experts that return their input: each token
// comes back as x times the weights of its selections whose expert is live.
void moe_step(EpBuffer& ep, int rank, int world, uint64_t seq, const std::vector<int32_t>& live,
              cudaStream_t stream) {
  const EpShape shape{kT, kH, world, kExpertsPerRank * world};
  EpArrays io(shape, kT, kK);
  std::vector<uint16_t> x(kT * kH);
  std::vector<int64_t> topk(kT * kK);
  std::vector<float> weights(kT * kK);
  for (int64_t t = 0; t < kT; ++t) {
    for (int64_t h = 0; h < kH; ++h) x[t * kH + h] = float_to_bf16(token_value(rank, t));
    for (int k = 0; k < kK; ++k) {
      topk[t * kK + k] = expert_of(rank, t, k, shape.num_experts);
      weights[t * kK + k] = kWeights[k];
    }
  }
  io.x.put(x);
  io.topk_idx.put(topk);
  io.topk_weights.put(weights);
  DeviceArray<int32_t> active(live);

  // A peer that is alive but silent would be masked after 2 s.
  const EpCall call = EpCall::of(shape, seq, 2'000'000'000, active.get());
  ep.dispatch(call, io.dispatch_args(), stream);
  // The experts return their input, so the combine's input is recv_x as it arrived.
  ep.combine(call, io.combine_args(io.recv_x.get()), stream);
  cuda_check(cudaStreamSynchronize(stream), "EP step");
  ep.raise_reported("EP step");

  const std::vector<uint16_t> got = io.out.take();
  int wrong = 0;
  for (int64_t t = 0; t < kT; ++t) {
    float w = 0;
    for (int k = 0; k < kK; ++k)
      if (live[static_cast<size_t>(expert_of(rank, t, k, shape.num_experts) / kExpertsPerRank)])
        w += kWeights[k];
    for (int64_t h = 0; h < kH; ++h)
      wrong += bf16_to_float(got[t * kH + h]) != w * token_value(rank, t);
  }
  expect(wrong == 0, rank,
         "EP step " + std::to_string(seq) + ": " + std::to_string(wrong) + " wrong channels");
}

float all_reduce_rank_plus_one(DeviceCollectives& coll, int rank, cudaStream_t stream) {
  DeviceArray<float> v(std::vector<float>(1024, static_cast<float>(rank + 1)));
  coll.all_reduce(v.get(), v.get(), 1024, DType::kFloat32, RedOp::kSum, stream);
  return v.take()[0];
}

// One process of the group; returns its exit code.
int run_rank(const std::string& dir, int rank, int world) {
  int gpus = 0;
  cuda_check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
  const int device = rank % gpus;
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  cudaStream_t stream;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");

  FileStore store(dir);  // a real deployment's store is a TCP one, as torchrun's
  TransferEngine engine(EngineOptions::from_env());
  Communicator comm(engine, store, "example/", rank, world, CommConfig::from_env(10000));
  DeviceCollectives coll(comm, store, "example/", device, DeviceCollectives::Options{});
  expect(coll.serves(4096, 10000), rank, "the device collectives serve this group");

  // The EP buffer: every rank publishes its card and maps the others'.
  const EpShape shape{kT, kH, world, kExpertsPerRank * world};
  EpBuffer ep(EpLayout(shape).total_bytes, device);
  store.set("example/card/" + std::to_string(rank), ep.card());
  std::vector<std::string> cards;
  for (int r = 0; r < world; ++r)
    cards.push_back(store.get("example/card/" + std::to_string(r), 10000));
  ep.connect(cards, rank);

  const float sum = all_reduce_rank_plus_one(coll, rank, stream);
  expect(sum == world * (world + 1) / 2.0f, rank, "all_reduce over everyone");
  std::vector<int32_t> live(static_cast<size_t>(world), 1);
  moe_step(ep, rank, world, 1, live, stream);
  if (rank == 0) std::printf("all %d ranks: all_reduce = %g, EP step 1 checked\n", world, sum);

  // The last rank dies (SIGKILL: no teardown). The survivors' next op finds
  // it gone, agrees on the survivors and covers them alone.
  comm.barrier();
  const int victim = world - 1;
  if (rank == victim) raise(SIGKILL);
  const float after = all_reduce_rank_plus_one(coll, rank, stream);
  expect(after == (world - 1) * world / 2.0f, rank, "all_reduce over the survivors");
  const View view = comm.view();
  for (int r = 0; r < world; ++r) live[static_cast<size_t>(r)] = view.is_member(r) ? 1 : 0;
  expect(live[static_cast<size_t>(victim)] == 0, rank, "the dead rank left the view");
  // The host's view is the kernels' mask: the dead rank's experts are skipped at once.
  moe_step(ep, rank, world, 2, live, stream);
  if (rank == 0)
    std::printf("rank %d killed; survivors %s: all_reduce = %g, EP step 2 checked\n", victim,
                view.describe().c_str(), after);
  comm.barrier();
  cudaStreamDestroy(stream);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 3;
  if (world < 2 || world > 8) {
    std::fprintf(stderr, "usage: %s [ranks in 2..8]\n", argv[0]);
    return 2;
  }
  char tmpl[] = "/tmp/mooncake-example-XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) return 1;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {  // before this process touches CUDA
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 1;
      try {
        code = run_rank(dir, r, world);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(nullptr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (int r = 0; r < world; ++r) {
    int status = 0;
    waitpid(pids[static_cast<size_t>(r)], &status, 0);
    const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    if (r == world - 1 ? !killed : !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) ++failed;
  }
  std::filesystem::remove_all(dir);
  std::printf("%s\n", failed == 0 ? "example passed" : "example FAILED");
  return failed == 0 ? 0 : 1;
}
