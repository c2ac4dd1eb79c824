// LaunchOrder (device/cuda.h): a launch on another stream than the last one
// waits for it, and one under capture leaves the capture intact. The "launches" here are
// host functions queued on the streams, which keep stream order and event
// waits as kernels do, and can say what they saw.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "device/cuda.h"
#include "gpu.h"

namespace mctest {
namespace {

using mooncake::cuda_check;
using mooncake::LaunchOrder;

struct Steps {
  std::atomic<int> done{0};  // the slow launch's mark
  int seen = -1;             // what the next launch found
};

void slow(void* p) {
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  static_cast<Steps*>(p)->done.store(1);
}

void look(void* p) {
  auto* s = static_cast<Steps*>(p);
  s->seen = s->done.load();
}

cudaStream_t non_blocking() {
  cudaStream_t s = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return s;
}

TEST(LaunchOrder, ALaunchOnAnotherStreamWaitsForTheLast) {
  MC_REQUIRE_GPU();
  // In a rank of its own: this process must not touch CUDA (gpu.h).
  run_ranks(1, [](Rank&) {
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    LaunchOrder order;
    Steps steps;
    cudaStream_t a = non_blocking(), b = non_blocking();
    order.before(a);
    cuda_check(cudaLaunchHostFunc(a, slow, &steps), "cudaLaunchHostFunc");
    order.after(a);
    order.before(b);
    cuda_check(cudaLaunchHostFunc(b, look, &steps), "cudaLaunchHostFunc");
    order.after(b);
    cuda_check(cudaStreamSynchronize(b), "cudaStreamSynchronize");
    EXPECT_EQ(steps.seen, 1) << "the launch on b ran before the one on a had finished";
    // A stream made after one is destroyed (it may get the handle back) is still
    // another stream: its launch waits for the last one too.
    cuda_check(cudaStreamSynchronize(a), "cudaStreamSynchronize");
    Steps again;
    order.before(b);
    cuda_check(cudaLaunchHostFunc(b, slow, &again), "cudaLaunchHostFunc");
    order.after(b);
    cuda_check(cudaStreamDestroy(b), "cudaStreamDestroy");
    cudaStream_t c = non_blocking();
    order.before(c);
    cuda_check(cudaLaunchHostFunc(c, look, &again), "cudaLaunchHostFunc");
    order.after(c);
    cuda_check(cudaStreamSynchronize(c), "cudaStreamSynchronize");
    EXPECT_EQ(again.seen, 1) << "a new stream's launch ran before the last one had finished";
    cudaStreamDestroy(a);
    cudaStreamDestroy(c);
  });
}

void count(void* p) {
  ++*static_cast<int*>(p);
}

TEST(LaunchOrder, CapturedLaunchesKeepTheCaptureIntact) {
  MC_REQUIRE_GPU();
  run_ranks(1, [](Rank&) {
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    LaunchOrder order;
    int runs = 0;
    cudaStream_t s = non_blocking();
    order.before(s);  // an eager launch first: the capture must not wait for its event
    cuda_check(cudaLaunchHostFunc(s, count, &runs), "cudaLaunchHostFunc");
    order.after(s);
    cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    // Global mode, as torch captures: a call not allowed under capture breaks it.
    cuda_check(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    for (int i = 0; i < 2; ++i) {
      order.before(s);
      cuda_check(cudaLaunchHostFunc(s, count, &runs), "cudaLaunchHostFunc");
      order.after(s);
    }
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess) << "the capture broke";
    cudaGraphExec_t exec = nullptr;
    cuda_check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    cuda_check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
    cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    EXPECT_EQ(runs, 3);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  });
}

}  // namespace
}  // namespace mctest
