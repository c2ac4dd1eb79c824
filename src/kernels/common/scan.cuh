// Prefix sums and lookups in them, and work dealt round-robin over the grid.
#pragma once

#include <cstdint>

namespace mooncake::kernels {

// The inclusive prefix sum of x over the warp's lanes (all of them call it).
__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
  int incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  return incl;
}

// Exclusive prefix sums of v[0, n) into out[0, n) (out may be v), by one warp
// (the lanes take 32 values at a time). Returns the total to every lane.
// Index: int or int64_t, n's type.
template <typename Index>
__device__ inline int warp_scan(const int32_t* v, int32_t* out, Index n, int lane) {
  int carry = 0;
  for (Index b = 0; b < n; b += 32) {
    const int x = b + lane < n ? v[b + lane] : 0;
    const int incl = warp_inclusive_sum(x, lane);
    if (b + lane < n) out[b + lane] = carry + incl - x;
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  return carry;
}

// The same, and out[n] = the total.
__device__ inline void warp_exclusive_scan(const int32_t* v, int32_t* out, int n, int lane) {
  const int total = warp_scan(v, out, n, lane);
  if (lane == 0) out[n] = total;
}

// Exclusive prefix sums of v[0, n) in place, by the whole block (every thread
// calls it; v in shared memory), two values a thread: n <= 2 * blockDim.x, and
// v[n] = the total. warp_total: shared scratch of blockDim.x / 32 ints. Ends
// with a barrier, so every thread may read any sum.
__device__ inline void block_exclusive_scan(int32_t* v, int n, int32_t* warp_total) {
  const int i = static_cast<int>(threadIdx.x), lane = i % 32, warp = i / 32;
  const int warps = static_cast<int>(blockDim.x) / 32;
  const int a = 2 * i < n ? v[2 * i] : 0, b = 2 * i + 1 < n ? v[2 * i + 1] : 0;
  const int incl = warp_inclusive_sum(a + b, lane);
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int t = lane < warps ? warp_total[lane] : 0;
    const int before = warp_inclusive_sum(t, lane) - t;
    if (lane < warps) warp_total[lane] = before;
  }
  __syncthreads();
  const int before = warp_total[warp] + incl - (a + b);
  if (2 * i < n) v[2 * i] = before;
  if (2 * i + 1 < n) v[2 * i + 1] = before + a;
  if (i == static_cast<int>(blockDim.x) - 1) v[n] = before + a + b;
  __syncthreads();
}

// The last i with offsets[i] <= g, for offsets[0] == 0 <= g < offsets[n].
__device__ __forceinline__ int find_segment(const int32_t* offsets, int n, int g) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= g)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// How many of `count` things, dealt round-robin over the grid, block b gets.
__device__ __forceinline__ int dealt(int count) {
  const int b = static_cast<int>(blockIdx.x), g = static_cast<int>(gridDim.x);
  return b < count ? (count - b + g - 1) / g : 0;
}

}  // namespace mooncake::kernels
