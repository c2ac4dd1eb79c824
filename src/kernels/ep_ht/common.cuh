// What the high-throughput kernels (layout.cu, dispatch.cu, combine.cu) share:
// signal words, liveness, the routing's lookups, the grid's roles, and the
// last block's ticket. api.h says what lives where.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/ep_ht/api.h"

namespace mooncake::kernels::ep_ht {

// min and max for host and device code alike.
template <typename T>
__host__ __device__ __forceinline__ T imin(T a, T b) {
  return a < b ? a : b;
}
template <typename T>
__host__ __device__ __forceinline__ T imax(T a, T b) {
  return a > b ? a : b;
}

__device__ __forceinline__ uint64_t* word_at(uint8_t* base, size_t offset) {
  return reinterpret_cast<uint64_t*>(base + offset);
}

__device__ __forceinline__ uint32_t tag_in(uint64_t v) {
  return static_cast<uint32_t>(v >> 32);
}
__device__ __forceinline__ uint32_t count_in(uint64_t v) {
  return static_cast<uint32_t>(v) & ~kDone;
}
__device__ __forceinline__ bool done_in(uint64_t v) {
  return (static_cast<uint32_t>(v) & kDone) != 0;
}

// Whether rank r takes part now: unmasked, mapped, and not seen gone by the host.
__device__ __forceinline__ bool live(const Common& c, int r) {
  return ld_volatile(c.active_ranks + r) != 0 && c.peers[r] != nullptr && !host_lost(c, r, true);
}

// The expert of slot k of token t, or -1 (none, or out of range: the layout
// pass reports that once).
__device__ __forceinline__ int64_t expert_at(const HtRouting& r, int64_t t, int k) {
  const int64_t e = load_idx(r.topk_idx, t * r.topk + k, r.topk_int64);
  return e >= 0 && e < r.num_experts ? e : -1;
}

// The layout pass's places, made whole: token t's place among the tokens this
// rank sends rank d (slot k's), and among its tokens of expert e (slot k's).
__device__ __forceinline__ int32_t place_of(const HtRouting& r, int64_t t, int k, int d) {
  const int64_t chunk = t / r.chunk_tokens;
  return r.chunk_tab[d * r.num_chunks + chunk] + r.inpos[t * r.topk + k];
}
__device__ __forceinline__ int32_t rank_of(const HtRouting& r, int R, int64_t t, int k, int64_t e) {
  const int64_t chunk = t / r.chunk_tokens;
  return r.chunk_tab[(R + e) * r.num_chunks + chunk] + r.inrank[t * r.topk + k];
}

// A rank's channel c: tokens [first, end) of its n (the same cut on every rank
// for its own tokens).
struct Span {
  int64_t first, end;
};
__device__ __forceinline__ Span channel_span(int64_t n, int64_t channels, int64_t c) {
  const int64_t per = (n + channels - 1) / channels;
  const int64_t first = c * per < n ? c * per : n;
  return Span{first, first + per < n ? first + per : n};
}

// The grid's roles: with peers, the first half of the blocks send (dispatch)
// or reply (combine) and the rest receive or reduce; alone, every block
// receives. A block serves channels in increasing order, so blocks of
// different ranks that serve different channel sets still never wait on each
// other in a cycle.
struct Roles {
  int senders;  // blocks [0, senders) send
  __device__ bool sends() const { return static_cast<int>(blockIdx.x) < senders; }
  __device__ int index() const { return sends() ? blockIdx.x : blockIdx.x - senders; }
  __device__ int count() const { return sends() ? senders : gridDim.x - senders; }
};
__device__ __forceinline__ Roles roles_of(int R) {
  return Roles{R > 1 ? static_cast<int>(gridDim.x) / 2 : 0};
}

// The last block's ticket: every block calls it once (after a __syncthreads),
// and the last one to arrive gets true, sees every other block's writes, and
// puts the counter back for the next launch. No block waits for another.
__device__ __forceinline__ bool last_block(uint32_t* counter, bool* s_flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const bool last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) *counter = 0;
    *s_flag = last;
  }
  __syncthreads();
  if (!*s_flag) return false;
  __threadfence();
  return true;
}

// Copies 4-byte words [lane, n) of a row, a warp's lanes striding.
__device__ __forceinline__ void copy_words(uint8_t* dst, const uint8_t* src, int64_t bytes,
                                           int lane) {
  auto* d = reinterpret_cast<uint32_t*>(dst);
  const auto* s = reinterpret_cast<const uint32_t*>(src);
  for (int64_t i = lane; i < bytes / 4; i += 32) d[i] = s[i];
}

__device__ __forceinline__ void zero_words(uint8_t* dst, int64_t bytes, int lane) {
  auto* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = lane; i < bytes / 4; i += 32) d[i] = 0;
}

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw_error(ErrorKind::kSystem, -1, what, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace mooncake::kernels::ep_ht
