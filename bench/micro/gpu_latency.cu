// What the device path's signalling primitives cost on this GPU, one number each:
// a read of host-mapped memory (one block, then many at once), system-scope
// loads, stores and fences on device memory, __nanosleep's real length, the
// %globaltimer's step, and a ping-pong between two kernels running side by side
// (the signalling of two ranks' kernels, in one process). The kernels
// (src/kernels/) poll such words in every wait; this says which ones are cheap.
//
//   nvcc -O3 -std=c++20 -arch=sm_90 -I src bench/micro/gpu_latency.cu -o /tmp/gpu_latency
//   /tmp/gpu_latency            # one line per measure: name, ns per operation
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/common/ptx.cuh"

using mooncake::kernels::ld_acquire_sys;
using mooncake::kernels::now_ns;
using mooncake::kernels::st_release_sys;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

constexpr int kReps = 2000;

// Thread 0 of each block: kReps dependent volatile reads of `word` (each
// address depends on the last value, so they cannot overlap); ns per read.
__global__ void chained_reads(const int32_t* word, uint64_t* out) {
  if (threadIdx.x != 0) return;
  int32_t v = 0;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < kReps; ++i) v = *reinterpret_cast<const volatile int32_t*>(word + (v & 0));
  const uint64_t t1 = now_ns();
  out[blockIdx.x] = (t1 - t0) + (v == 12345 ? 1 : 0);
}

__global__ void chained_acquire(const uint64_t* word, uint64_t* out) {
  if (threadIdx.x != 0) return;
  uint64_t v = 0;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < kReps; ++i) v = ld_acquire_sys(word + (v & 0));
  out[blockIdx.x] = now_ns() - t0 + (v == 12345 ? 1 : 0);
}

__global__ void release_stores(uint64_t* word, uint64_t* out) {
  if (threadIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < kReps; ++i) st_release_sys(word + blockIdx.x * 16, i);
  out[blockIdx.x] = now_ns() - t0;
}

__global__ void fences(uint64_t* word, uint64_t* out) {
  if (threadIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < kReps; ++i) {
    word[blockIdx.x * 16] = i;
    __threadfence_system();
  }
  out[blockIdx.x] = now_ns() - t0;
}

__global__ void sleeps(uint64_t* out, unsigned ns) {
  if (threadIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < 200; ++i) __nanosleep(ns);
  out[blockIdx.x] = (now_ns() - t0) * kReps / 200;  // scaled to kReps like the others
}

// The smallest nonzero step between two reads of %globaltimer.
__global__ void timer_step(uint64_t* out) {
  uint64_t best = ~0ull, last = now_ns();
  for (int i = 0; i < 100000; ++i) {
    const uint64_t t = now_ns();
    if (t != last && t - last < best) best = t - last;
    last = t;
  }
  out[0] = best;
}

// Ping-pong: side 0 writes i to ping and waits for pong == i; side 1 answers.
// The two sides are two kernels on two streams (as two ranks' kernels are).
__global__ void ping_pong(uint64_t* ping, uint64_t* pong, int side, const int32_t* host_word,
                          int host_every, uint64_t* out) {
  if (threadIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  int32_t sink = 0;
  for (uint64_t i = 1; i <= kReps; ++i) {
    if (side == 0) st_release_sys(ping, i);
    uint64_t* wait_on = side == 0 ? pong : ping;
    for (uint32_t round = 0; ld_acquire_sys(wait_on) < i; ++round) {
      if (host_every > 0 && round % host_every == host_every - 1)
        sink += *reinterpret_cast<const volatile int32_t*>(host_word);
      __nanosleep(100);
    }
    if (side == 1) st_release_sys(pong, i);
  }
  out[side] = now_ns() - t0 + (sink == 12345 ? 1 : 0);
}

double run_blocks(const char* name, int blocks, uint64_t* out, void (*launch)(int, uint64_t*)) {
  check(cudaMemset(out, 0, 1024 * sizeof(uint64_t)), "memset");
  launch(blocks, out);
  check(cudaDeviceSynchronize(), name);
  std::vector<uint64_t> h(blocks);
  check(cudaMemcpy(h.data(), out, blocks * sizeof(uint64_t), cudaMemcpyDeviceToHost), "copy");
  uint64_t worst = 0, sum = 0;
  for (uint64_t v : h) {
    worst = v > worst ? v : worst;
    sum += v;
  }
  const double mean = static_cast<double>(sum) / blocks / kReps, max = double(worst) / kReps;
  std::printf("%-44s blocks %4d  mean %9.1f ns  worst block %9.1f ns\n", name, blocks, mean, max);
  return mean;
}

}  // namespace

int main() {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attr");
  int32_t* host = nullptr;
  int32_t* host_dev = nullptr;
  check(cudaHostAlloc(reinterpret_cast<void**>(&host), 4096, cudaHostAllocMapped), "hostalloc");
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0), "devptr");
  host[0] = 0;
  uint64_t *out = nullptr, *words = nullptr;
  check(cudaMalloc(&out, 1024 * sizeof(uint64_t)), "malloc");
  check(cudaMalloc(&words, 4096 * sizeof(uint64_t)), "malloc");
  check(cudaMemset(words, 0, 4096 * sizeof(uint64_t)), "memset");
  static int32_t* s_host;
  static uint64_t* s_words;
  s_host = host_dev;
  s_words = words;
  std::printf("# %d SMs; ns per operation (%d chained in one thread of each block)\n", sms, kReps);
  for (int b : {1, 16, sms / 2, sms}) {
    run_blocks("volatile read of host-mapped memory", b, out,
               [](int n, uint64_t* o) { chained_reads<<<n, 32>>>(s_host, o); });
  }
  for (int b : {1, sms}) {
    run_blocks("ld.acquire.sys of device memory (one word)", b, out,
               [](int n, uint64_t* o) { chained_acquire<<<n, 32>>>(s_words, o); });
    run_blocks("st.release.sys to device memory", b, out,
               [](int n, uint64_t* o) { release_stores<<<n, 32>>>(s_words, o); });
    run_blocks("store + __threadfence_system", b, out,
               [](int n, uint64_t* o) { fences<<<n, 32>>>(s_words, o); });
  }
  run_blocks("__nanosleep(100)", 1, out, [](int n, uint64_t* o) { sleeps<<<n, 32>>>(o, 100); });
  run_blocks("__nanosleep(128)", 1, out, [](int n, uint64_t* o) { sleeps<<<n, 32>>>(o, 128); });
  timer_step<<<1, 1>>>(out);
  check(cudaDeviceSynchronize(), "timer");
  uint64_t step = 0;
  check(cudaMemcpy(&step, out, sizeof(step), cudaMemcpyDeviceToHost), "copy");
  std::printf("%-44s %llu ns\n", "%globaltimer step", static_cast<unsigned long long>(step));

  cudaStream_t s0, s1;
  check(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking), "stream");
  check(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), "stream");
  for (int every : {0, 16, 1}) {
    check(cudaMemset(words, 0, 4096 * sizeof(uint64_t)), "memset");
    check(cudaDeviceSynchronize(), "sync");
    ping_pong<<<1, 32, 0, s1>>>(words, words + 64, 1, host_dev, every, out);
    ping_pong<<<1, 32, 0, s0>>>(words, words + 64, 0, host_dev, every, out);
    check(cudaDeviceSynchronize(), "ping-pong");
    uint64_t h[2];
    check(cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost), "copy");
    std::printf("ping-pong round trip, host read every %2d polls  %9.1f ns\n", every,
                double(h[0]) / kReps);
  }
  return 0;
}
