// What the low-latency EP kernels (dispatch.cu, combine.cu) share: their
// work sizes, the mask snapshot, and the launchers' shared-memory checks.
// api.h says what the phases, signals and status mean; ep/layout.h where
// everything lives.
//
// Work is dealt round-robin over the grid (block b takes things b, b + G, ...)
// and every block gathers all of its work before it moves any bytes, so that
// each copy phase has every warp of the block busy at once: at world 1 a block
// holds ~2 experts of ~4 rows each, and doing them one after the other was
// most of the kernels' time.
//
// A rank's rows for its own experts, in one launch: dispatch copies BF16/FP16
// ones from x, and combine sums those expert outputs straight from its x (a
// split combine copies them in its send half, as the hook may come after x
// changed).
//
// Blocks never wait on blocks that have not started: every block does its
// send work before it waits, and the grid is at most as large as what is
// resident at once (the host sizes it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "ep/layout.h"
#include "kernels/api.h"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"

namespace mooncake::kernels::ep_ll {

constexpr int kWarps = kThreads / 32;

// The mask as this launch found it, in shared memory: one load per rank per
// block at the start (beside the launch's first loads), instead of a
// dependent global load before each use. Ranks past kSnapRanks read the
// global mask. Waits still read it live, where another thread may mask a
// silent peer.
constexpr int kSnapRanks = 1024;

// Whether this process's peers left it out (Common::fence, api.h): a load of
// its own workspace's control word, where they store it. Each store phase
// into peers looks right before it starts (and reports it, for the host).
__device__ __forceinline__ bool fenced(const Common& c) {
  if (ld_volatile(c.fence) == 0) return false;
  if (threadIdx.x == 0) report(c.status, kStatusLeftOut, c.rank, 0);  // (host memory: one a block)
  return true;
}

// The tag of this call's signals and headers from rank r (its process's
// fence key: EpLayout::tag_of); r = this rank: the tag it writes.
__device__ __forceinline__ uint32_t tag_from(const Common& c, int r) {
  return EpLayout::tag_of(c.seq, c.keys[r]);
}

struct MaskSnapshot {
  uint8_t live[kSnapRanks];
  bool out;  // fenced at the launch's start: no peer is live

  // Every thread calls it; a __syncthreads must follow before the first use.
  // A fenced process sends to nobody and waits for nobody. (A rank the host
  // has seen gone is masked by the first wait on it: wait.cuh's host_lost;
  // reading the host's words here, in every block, would queue each read
  // behind every other block's.)
  __device__ void load(const Common& c, int R) {
    const bool fence = fenced(c);
    if (threadIdx.x == 0) out = fence;
    for (int r = threadIdx.x; r < R && r < kSnapRanks; r += kThreads)
      live[r] = (!fence || r == c.rank) && live_now(c, r);
  }
  __device__ bool operator()(const Common& c, int r) const {
    return r < kSnapRanks ? live[r] != 0 : (!out || r == c.rank) && live_now(c, r);
  }
  // A rank with no mapping (an elastic buffer's slot not published) is never
  // live, whatever the masks say: nothing may be stored through its entry.
  static __device__ bool live_now(const Common& c, int r) {
    return ld_volatile(c.active_ranks + r) != 0 &&
           (c.slot_mask == nullptr || ld_volatile(c.slot_mask + r) != 0) && c.peers[r] != nullptr;
  }
};

// The launch's shape, as both kernels read it first: ranks, experts, local
// experts, blocks, tokens per rank and hidden size.
struct Shape {
  const EpLayout& L;
  int R, E, epr, G;
  int64_t T, H;
};

__device__ __forceinline__ Shape shape_of(const Common& c) {
  const EpLayout& L = c.layout;
  return Shape{L,
               static_cast<int>(L.shape.num_ranks),
               static_cast<int>(L.shape.num_experts),
               static_cast<int>(L.local_experts),
               static_cast<int>(gridDim.x),
               L.shape.max_tokens,
               L.shape.hidden};
}

// Rows a copy phase (dispatch receive, combine send) collects before it
// copies them: each with its source and destination, in shared memory, so
// that the copy loop's every step is loads and stores with no global lookups
// between them (reading headers, the peer table or src_info there was a
// chain of dependent round trips per chunk, most of those phases' time).
constexpr int kItems = 2048;
// Rows a combine's receive phase loads at once per thread.
constexpr int kLoads = 8;
// Tokens a combine's receive phase takes at once (a thread per column).
constexpr int kBatch = kThreads / EpLayout::kMaxTopk;

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw_error(ErrorKind::kSystem, -1, what, ": kernel launch failed: ", cudaGetErrorString(err));
}

// Blocks get work round-robin, so each holds at most ceil(n / grid) of n things.
inline int64_t per_block(int64_t n, int64_t grid) {
  return (n + grid - 1) / grid;
}

// Shared memory past the default 48 KiB (static and dynamic together) needs
// the kernel's consent (launches with more experts per block than fit in
// the default are rare: a small grid and ~300+ experts). The static part is
// at most the send items, the combine's batch and a few small arrays.
constexpr size_t kStaticSmem = kItems * (sizeof(void*) + sizeof(int32_t)) +
                               kBatch * (EpLayout::kMaxTopk * 20 + 4) + kSnapRanks + 512;

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes, const char* what) {
  if (bytes + kStaticSmem <= 48 * 1024) return;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(bytes));
  if (err != cudaSuccess)
    throw_error(ErrorKind::kInvalidArgument, -1, what, ": ", bytes,
                " bytes of shared memory per block are more than the GPU allows (",
                cudaGetErrorString(err), "): use fewer experts per rank or a larger grid");
}

}  // namespace mooncake::kernels::ep_ll
