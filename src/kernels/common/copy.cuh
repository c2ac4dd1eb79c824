// Row copies by whole warps, in chunks.
#pragma once

#include <cstdint>

namespace mooncake::kernels {

// Rows move in chunks of kChunkBytes, a warp per chunk (kVecs 16-byte loads
// in flight per lane, all issued before any store), so that a few rows still
// spread over every warp. The kernels are latency-bound at these sizes (a
// block holds ~8 rows): 8 loads a lane halved the copy loops' round trips
// against 4.
constexpr int kVecs = 8;
constexpr int64_t kChunkBytes = 32 * kVecs * 16;

__device__ __forceinline__ int64_t chunks_of(int64_t bytes) {
  return (bytes + kChunkBytes - 1) / kChunkBytes;
}

// Loads a lane's share of chunk `c` of a row of `bytes` (a multiple of 16;
// 16-byte aligned) into v, every load issued before any use. kFresh: plain
// loads, for data another rank stores during this launch (the read-only path
// may not see it).
template <bool kFresh>
__device__ __forceinline__ void load_chunk(int4 (&v)[kVecs], const uint8_t* src, int64_t bytes,
                                           int64_t c, int lane) {
  const int64_t n = bytes / 16, first = c * (kChunkBytes / 16) + lane;
  const auto* s = reinterpret_cast<const int4*>(src);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t i = first + 32 * j;
    if (i < n) v[j] = kFresh ? s[i] : __ldg(s + i);
  }
}

// Stores what load_chunk loaded into the same chunk of another row.
__device__ __forceinline__ void store_chunk(uint8_t* dst, const int4 (&v)[kVecs], int64_t bytes,
                                            int64_t c, int lane) {
  const int64_t n = bytes / 16, first = c * (kChunkBytes / 16) + lane;
  auto* d = reinterpret_cast<int4*>(dst);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t i = first + 32 * j;
    if (i < n) d[i] = v[j];
  }
}

// Copies chunk `c` of a row (both ends 16-byte aligned), as load_chunk.
template <bool kFresh>
__device__ __forceinline__ void copy_chunk(uint8_t* dst, const uint8_t* src, int64_t bytes,
                                           int64_t c, int lane) {
  int4 v[kVecs];
  load_chunk<kFresh>(v, src, bytes, c, lane);
  store_chunk(dst, v, bytes, c, lane);
}

}  // namespace mooncake::kernels
