// EP dispatch and combine on the GPU, over workspaces every rank maps
// (api.h says what the phases, signals and status mean; ep/layout.h where
// everything lives).
//
// Work is dealt round-robin over the grid (block b takes things b, b + G, ...)
// and every block gathers all of its work before it moves any bytes, so that
// each copy phase has every warp of the block busy at once: at world 1 a block
// holds ~2 experts of ~4 rows each, and doing them one after the other was
// most of the kernels' time.
//
// Dispatch, send phase: the grid first puts this rank's tokens into its
// stage, once per token (FP8: quantised there; quantising per destination
// instead made the send phase 6-9 us slower, as it does the work K times at
// low occupancy, and a quantise kernel of its own cost a second launch,
// several us of host time per call; BF16/FP16: copied there, except at world
// 1 in one launch). One pass over topk_idx in flat order gives each selection
// of the block's experts the next slot of its expert (a source's rows reach
// the receiver in token order, as the portable path orders them) and stores
// the row's header there, in the owner's [local expert][this rank] slots.
// After a grid barrier (every block's stage rows are in) the counts are
// published with system-scope releases.
// Receive phase: the block waits for the counts of all its local experts (a
// thread per (expert, source), each with the phase's deadline), lays the
// sources out in rank order, and copies every row's bytes from its source's
// stage (mapped, as the whole workspace is) straight into recv_x, filling
// src_info and layout_range. Pulling the rows moves each selected row once;
// pushing them into the receiver's slots first moved it twice, which
// cost little at world 1 but doubled the bytes when several ranks share a GPU.
//
// Combine, send phase: the block copies the expert outputs of its (local
// expert, source) pairs from x into this rank's rows region, packed by
// source (nothing to copy when x is that region: the zero-copy buffer), then
// raises one flag per pair at the source, carrying the row where the pair's
// rows start. Packed, a token owner's rows at a peer lie together (about T*K/R
// of them); in recv_x's layout they lie in E/R places R*T rows apart, and
// with 8 ranks on one GPU reading rows from that many places made the
// receive phase 2.4x slower (145 against 60 us; each place its own pages, so
// address translation is the likely cost).
// Receive phase: a block
// takes its tokens a batch at a time; for each selection it waits for the
// expert's flag, finds the row (that start plus the slot the dispatch
// recorded in the index region) and sums weight * row in fp32 straight from
// the expert owner's workspace, in ascending expert order (the portable
// path's order, so the result is bit-identical), rounded once.
//
// A rank's rows for its own experts, in one launch: dispatch copies BF16/FP16
// ones from x, and combine sums those expert outputs straight from its x (a
// split combine copies them in its send half, as the hook may come after x
// changed).
//
// Blocks never wait on blocks that have not started: every block does its
// send work before it waits, and the grid is at most as large as what is
// resident at once (the host sizes it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/api.h"

namespace mooncake::kernels {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Signals between ranks are system-scope (a peer may be on another GPU).
// GPU scope for peers all on this GPU measured the same (20.0 against
// 20.2 us per FP8 dispatch and combine on an H200), so there is one kind.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// First error wins; the words live in host-mapped memory, so plain stores
// (a race between two reporters can only mix their details).
__device__ void report(int32_t* status, int code, int d0, int d1) {
  volatile int32_t* s = status;
  if (s[0] != kStatusOk) return;
  s[1] = d0;
  s[2] = d1;
  __threadfence_system();
  s[0] = code;
}

__device__ __forceinline__ int64_t load_idx(const void* p, int64_t i, bool is64) {
  return is64 ? __ldg(static_cast<const long long*>(p) + i) : __ldg(static_cast<const int*>(p) + i);
}

__device__ __forceinline__ uint64_t deadline_of(int64_t timeout_ns) {
  const uint64_t now = now_ns();
  return now + static_cast<uint64_t>(timeout_ns);
}

// Waits until `*signal` satisfies `ready`, the source is masked, or the
// deadline passes (then masks the source). True when the signal arrived.
template <typename Ready>
__device__ bool wait_for(const Common& c, const uint64_t* signal, Ready ready, uint64_t deadline,
                         int source, int phase, uint64_t* value) {
  int32_t* active = c.active_ranks;
  int32_t* slots = c.slot_mask;
  int32_t* status = c.status;
  while (true) {
    const uint64_t v = ld_acquire_sys(signal);
    if (ready(v)) {
      *value = v;
      return true;
    }
    if (ld_volatile(active + source) == 0) return false;
    if (slots != nullptr && ld_volatile(slots + source) == 0) return false;
    if (now_ns() > deadline) {
      const bool first = atomicExch(active + source, 0) != 0;
      if (slots != nullptr) atomicExch(slots + source, 0);
      if (first) {
        report(status, kStatusSilentPeer, source, phase);
        volatile int32_t* timeouts = status + 3;
        *timeouts = *timeouts + 1;
        if (c.silent != nullptr) {
          *reinterpret_cast<volatile int32_t*>(c.silent + source) = 1;
          __threadfence_system();
        }
      }
      return false;
    }
    __nanosleep(100);
  }
}

// BF16/FP16 pairs to and from fp32 (round to nearest on the way back).
template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using Two = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(Two v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ Two from_floats(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};
template <>
struct Pair<__half> {
  using Two = __half2;
  static __device__ __forceinline__ float2 to_float2(Two v) { return __half22float2(v); }
  static __device__ __forceinline__ Two from_floats(float a, float b) {
    return __floats2half2_rn(a, b);
  }
};

// 8 channels (16 bytes) of T to fp32 and back.
template <typename T>
__device__ __forceinline__ void to_float8(const int4& v, float (&f)[8]) {
  const auto* h = reinterpret_cast<const typename Pair<T>::Two*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = Pair<T>::to_float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ int4 from_float8(const float (&f)[8]) {
  int4 v;
  auto* h = reinterpret_cast<typename Pair<T>::Two*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = Pair<T>::from_floats(f[2 * i], f[2 * i + 1]);
  return v;
}

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

// Copies chunk `c` of a row of `bytes` (a multiple of 16; both ends 16-byte
// aligned). kFresh: plain loads, for data another rank stores during this
// launch (the read-only path may not see it).
template <bool kFresh>
__device__ __forceinline__ void copy_chunk(uint8_t* dst, const uint8_t* src, int64_t bytes,
                                           int64_t c, int lane) {
  const int64_t n = bytes / 16, first = c * (kChunkBytes / 16) + lane;
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  int4 v[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t i = first + 32 * j;
    if (i < n) v[j] = kFresh ? s[i] : __ldg(s + i);
  }
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t i = first + 32 * j;
    if (i < n) d[i] = v[j];
  }
}

// FP8 work units: kQuantBlocks 128-channel blocks of a token, quantised by a
// half-warp (8 channels a lane, the blocks' loads all in flight first).
// scale = max(amax, 1e-4) / 448 and data = sat(x * (448 / max(amax, 1e-4))),
// as mooncake.fp8.quantize computes them (IEEE division and multiplication,
// round to nearest), so both paths send the same bytes.
constexpr int kQuantBlocks = 4;

template <typename T>
__device__ __forceinline__ void quantize_blocks(const T* x, uint8_t* data, float* scales,
                                                int64_t first, int64_t blocks, int lane) {
  const int sub = lane % 16;
  const unsigned half = 0xffffu << (lane & 16);
  int4 raw[kQuantBlocks];
#pragma unroll
  for (int b = 0; b < kQuantBlocks; ++b)
    if (first + b < blocks)
      raw[b] = __ldg(reinterpret_cast<const int4*>(x + (first + b) * 128 + sub * 8));
#pragma unroll
  for (int b = 0; b < kQuantBlocks; ++b) {
    if (first + b >= blocks) break;  // the same for the whole half-warp
    float f[8];
    to_float8<T>(raw[b], f);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(half, amax, o));
    amax = fmaxf(amax, kAmaxFloor);
    const float inv = __fdiv_rn(kE4m3Max, amax);
    uint8_t q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      q[i] = __nv_cvt_float_to_fp8(__fmul_rn(f[i], inv), __NV_SATFINITE, __NV_E4M3);
    const int64_t block = first + b;
    *reinterpret_cast<uint2*>(data + block * 128 + sub * 8) = *reinterpret_cast<const uint2*>(q);
    if (sub == 0) scales[block] = __fdiv_rn(amax, kE4m3Max);
  }
}

// FP8: this block's share of the rank's tokens quantised once into its stage
// rows (data, then scales), which the send phase then copies to every
// selected expert.
template <typename Elem>
__device__ void quantize_share(const DispatchArgs& a) {
  const EpLayout& L = a.c.layout;
  const int64_t H = L.shape.hidden, blocks = H / 128;
  const int64_t per_row = (blocks + kQuantBlocks - 1) / kQuantBlocks;
  uint8_t* own = a.c.peers[a.c.rank];
  const int64_t units = static_cast<int64_t>(gridDim.x) * kThreads / 16;
  for (int64_t u = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 16;
       u < a.num_tokens * per_row; u += units) {
    const int64_t t = u / per_row, c = u % per_row;
    uint8_t* row = own + L.stage_row(a.c.seq, t);
    quantize_blocks<Elem>(static_cast<const Elem*>(a.x) + t * H, row,
                          reinterpret_cast<float*>(row + H), c * kQuantBlocks, blocks,
                          threadIdx.x % 32);
  }
}

// BF16/FP16: the rank's tokens copied once into its stage rows, from which
// the receivers read them (peers, and this rank's own receive half when a
// hook splits the call: a later launch, when `x` may have changed).
__device__ void stage_share(const DispatchArgs& a) {
  const EpLayout& L = a.c.layout;
  const int64_t bytes = 2 * L.shape.hidden, per_row = chunks_of(bytes);
  uint8_t* own = a.c.peers[a.c.rank];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t u = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
       u < a.num_tokens * per_row; u += warps) {
    const int64_t t = u / per_row;
    copy_chunk<false>(own + L.stage_row(a.c.seq, t), static_cast<const uint8_t*>(a.x) + t * bytes,
                      bytes, u % per_row, threadIdx.x % 32);
  }
}

// A grid barrier in two halves, so that a block does other work between
// arriving and waiting. sync[0] counts arrivals, sync[1] is the generation:
// the last block to arrive resets the count and advances the generation,
// which the others wait for (the words return to a reusable state every
// time, so graph replays work). Called by one thread, after a __syncthreads.
__device__ __forceinline__ uint32_t grid_arrive(uint32_t* sync) {
  const uint32_t gen = *reinterpret_cast<volatile uint32_t*>(sync + 1);
  __threadfence();  // the block's stores (made visible to this thread by the barrier) first
  if (atomicAdd(sync, 1) == gridDim.x - 1) {
    *reinterpret_cast<volatile uint32_t*>(sync) = 0;
    __threadfence();
    atomicAdd(sync + 1, 1);
  }
  return gen;
}

// Waits for the generation after `gen`; past the deadline (blocks of the
// launch were not all resident: a GPU shared with other work) it reports and
// goes on, as the other waits do.
__device__ void grid_wait(uint32_t* sync, uint32_t gen, int64_t timeout_ns, int32_t* status) {
  const uint64_t deadline = now_ns() + static_cast<uint64_t>(timeout_ns);
  while (*reinterpret_cast<volatile uint32_t*>(sync + 1) == gen) {
    if (now_ns() > deadline) {
      report(status, kStatusNotResident,
             static_cast<int>(*reinterpret_cast<volatile uint32_t*>(sync)),
             static_cast<int>(gridDim.x));
      return;
    }
    __nanosleep(64);
  }
  __threadfence();  // the other blocks' stage rows, before this block reads them
}

// Exclusive prefix sums of v[0, n) into out[0, n], out[n] = the total, by
// one warp (the lanes take 32 values at a time).
__device__ void warp_exclusive_scan(const int32_t* v, int32_t* out, int n, int lane) {
  int carry = 0;
  for (int b = 0; b < n; b += 32) {
    const int x = b + lane < n ? v[b + lane] : 0;
    int incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (b + lane < n) out[b + lane] = carry + incl - x;
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) out[n] = carry;
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

// The mask as this launch found it, in shared memory: one load per rank per
// block at the start (beside the launch's first loads), instead of a
// dependent global load before each use. Ranks past kSnapRanks read the
// global mask. Waits still read it live, where another thread may mask a
// silent peer.
constexpr int kSnapRanks = 1024;

struct MaskSnapshot {
  uint8_t live[kSnapRanks];

  // Every thread calls it; a __syncthreads must follow before the first use.
  __device__ void load(const Common& c, int R) {
    for (int r = threadIdx.x; r < R && r < kSnapRanks; r += kThreads) live[r] = live_now(c, r);
  }
  __device__ bool operator()(const Common& c, int r) const {
    return r < kSnapRanks ? live[r] != 0 : live_now(c, r);
  }
  // A rank with no mapping (an elastic buffer's slot not published) is never
  // live, whatever the masks say: nothing may be stored through its entry.
  static __device__ bool live_now(const Common& c, int r) {
    return ld_volatile(c.active_ranks + r) != 0 &&
           (c.slot_mask == nullptr || ld_volatile(c.slot_mask + r) != 0) && c.peers[r] != nullptr;
  }
};

// How many of `count` things, dealt round-robin over the grid, block b gets.
__device__ __forceinline__ int dealt(int count) {
  const int b = static_cast<int>(blockIdx.x), g = static_cast<int>(gridDim.x);
  return b < count ? (count - b + g - 1) / g : 0;
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

template <typename Elem, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchArgs a) {
  extern __shared__ int32_t s_dyn[];  // send: counts per (expert, warp); receive: counts, offsets
  __shared__ const uint8_t* s_src[kItems];  // receive: a row's bytes (null: dropped)
  __shared__ int32_t s_row[kItems];         // and its row in recv_x

  const EpLayout& L = a.c.layout;
  const int R = static_cast<int>(L.shape.num_ranks);
  const int E = static_cast<int>(L.shape.num_experts);
  const int epr = static_cast<int>(L.local_experts);
  const int G = static_cast<int>(gridDim.x);
  const int64_t T = L.shape.max_tokens, H = L.shape.hidden;
  const int K = a.topk;
  const int64_t entries = a.num_tokens * K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1;
  const uint64_t seq = a.c.seq;
  uint8_t* own = a.c.peers[a.c.rank];
  __shared__ MaskSnapshot s_live;
  // The send pass's first topk_idx entry, loaded now so that its latency
  // overlaps the mask's (and FP8's quantisation); each round then loads the
  // next round's entry before it works on its own.
  int64_t next_id = (a.c.phases & kSend) && threadIdx.x < entries
                        ? load_idx(a.topk_idx, threadIdx.x, a.topk_int64)
                        : -1;
  s_live.load(a.c, R);
  __syncthreads();

  if (a.c.phases & kSend) {
    // Receivers read this rank's rows from its stage (FP8: quantised there;
    // BF16/FP16: copied there, except in a one-launch call at world 1, whose
    // receive phase reads x itself). Rows other blocks stage are read by
    // other ranks as soon as a count is out, so with peers (or FP8's own
    // rows, read by other blocks of this launch) the blocks meet at a grid
    // barrier before the first count goes out.
    __shared__ uint32_t s_gen;  // the grid barrier's generation at arrival
    bool staged = true;         // whether every block's stage rows are in
    if constexpr (kFp8) {
      quantize_share<Elem>(a);
      staged = false;
    } else if (R > 1 || a.c.phases != kBoth) {
      stage_share(a);
      staged = R == 1;  // a hook's receive half at world 1 is a later launch
    }
    if (!staged) {
      __syncthreads();
      if (threadIdx.x == 0) s_gen = grid_arrive(a.c.grid_sync);
    }
    // This block sends for experts blockIdx.x + i * G. One pass over topk_idx
    // in flat order gives each selection of them the next slot of its expert
    // (so a source's rows arrive in token order, as the portable path orders
    // them), and the slot gets the row's header; the receiver copies the
    // bytes from the stage (or x) straight into recv_x.
    const int nb = dealt(E);
    int32_t* s_base = s_dyn;                // [nb][kWarps]: this round's rows per warp, then bases
    int32_t* s_rows = s_dyn + nb * kWarps;  // [nb]: rows given so far
    for (int i = threadIdx.x; i < nb; i += kThreads) s_rows[i] = 0;
    for (int64_t round = 0; round < entries; round += kThreads) {
      for (int i = threadIdx.x; i < nb * kWarps; i += kThreads) s_base[i] = 0;
      __syncthreads();
      const int64_t j = round + threadIdx.x;
      int mine = -1;  // this entry's expert, as the block numbers them
      int64_t id = -1;
      if (j < entries) {
        id = next_id;
        if (j + kThreads < entries) next_id = load_idx(a.topk_idx, j + kThreads, a.topk_int64);
        if (blockIdx.x == 0 && (id < -1 || id >= E))
          report(a.c.status, kStatusBadExpert, static_cast<int>(id), static_cast<int>(j / K));
        if (id >= 0 && id < E && id % G == blockIdx.x && s_live(a.c, static_cast<int>(id / epr)))
          mine = static_cast<int>(id / G);
      }
      const unsigned same = __match_any_sync(0xffffffffu, mine);
      const int rank_in_warp = __popc(same & lanes_below);
      if (mine >= 0 && rank_in_warp == 0) s_base[mine * kWarps + warp] = __popc(same);
      __syncthreads();
      for (int i = threadIdx.x; i < nb; i += kThreads) {
        int at = s_rows[i];
        for (int w = 0; w < kWarps; ++w) {
          const int c = s_base[i * kWarps + w];
          s_base[i * kWarps + w] = at;
          at += c;
        }
        s_rows[i] = at;
      }
      __syncthreads();
      if (mine >= 0) {
        const int slot = s_base[mine * kWarps + warp] + rank_in_warp;
        const int e = static_cast<int>(id), t = static_cast<int>(j / K);
        const int k = static_cast<int>(j % K), le = e % epr;
        if (slot < T) {
          *reinterpret_cast<EpMsgHeader*>(a.c.peers[e / epr] + L.header(seq, le, a.c.rank, slot)) =
              EpMsgHeader{t, le, k, 0};
          // The combine finds this selection's expert output by its slot.
          *reinterpret_cast<uint64_t*>(own + L.combine_index(seq, t, k)) =
              (seq << 32) | static_cast<uint32_t>(slot);
        } else {
          report(a.c.status, kStatusOverflow, e, slot + 1);
        }
      }
      __syncthreads();  // s_base is refilled next round
    }
    if (entries == 0) __syncthreads();  // s_rows was zeroed
    if (!staged) {
      if (threadIdx.x == 0) grid_wait(a.c.grid_sync, s_gen, a.c.timeout_ns, a.c.status);
      __syncthreads();
    }
    // Every thread's stores are done (the barrier above), then each count is
    // published with a release, which is cumulative: it covers what the
    // barrier made visible to the publishing thread.
    for (int i = threadIdx.x; i < nb; i += kThreads) {
      const int e = static_cast<int>(blockIdx.x) + i * G;
      // This rank's flag for e in this half is next raised by e's owner in the
      // combine of this call, which follows the count below: clear it now.
      *reinterpret_cast<uint64_t*>(own + L.combine_flag(seq, e)) = 0;
      // Only live owners get a count. A masked one may run calls of another
      // R (an elastic buffer's slot alone, or of a different rank bound),
      // whose signals lie elsewhere: a count stored by this call's layout
      // landed on another (expert, source) of its own with a matching tag.
      // An owner that still counts this rank in waits out its deadline, as
      // on the portable path.
      if (!s_live(a.c, e / epr)) continue;
      uint8_t* owner = a.c.peers[e / epr];
      const uint64_t count = static_cast<uint64_t>(s_rows[i] < T ? s_rows[i] : T);
      st_release_sys(reinterpret_cast<uint64_t*>(owner + L.dispatch_count(seq, e % epr, a.c.rank)),
                     (seq << 32) | count);
    }
    __syncthreads();  // s_dyn is the receive phase's next
  }

  if (a.c.phases & kRecv) {
    // This block receives for local experts blockIdx.x + i * G: it waits for
    // all their counts at once, lays each expert's sources out in rank order
    // and unpacks every row with every warp.
    const int nl = dealt(epr);
    int32_t* s_count = s_dyn;                 // [nl][R]
    int32_t* s_off = s_count + nl * R;        // [nl][R + 1]
    int32_t* s_total = s_off + nl * (R + 1);  // [nl]
    int32_t* s_first = s_total + nl;  // [nl + 1]: each expert's first row in the block's list
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    const int64_t cols = R * T;
    for (int p = threadIdx.x; p < nl * R; p += kThreads) {
      const int le = static_cast<int>(blockIdx.x) + (p / R) * G, s = p % R;
      uint64_t v = 0;
      int count = 0;
      const auto* sig = reinterpret_cast<const uint64_t*>(own + L.dispatch_count(seq, le, s));
      const auto ready = [seq](uint64_t x) { return (x >> 32) == (seq & 0xffffffffu); };
      if (s_live(a.c, s) && wait_for(a.c, sig, ready, deadline, s, kRecv, &v)) {
        // Consumed: cleared, so a replay of a captured graph (the same
        // sequence number again) waits for the new count.
        *const_cast<uint64_t*>(sig) = 0;
        count = static_cast<int>(v & 0xffffffffu);
        if (count > T) {
          report(a.c.status, kStatusBadCount, s, count);
          count = 0;
        }
      }
      s_count[p] = count;
    }
    __syncthreads();
    for (int i = warp; i < nl; i += kWarps)
      warp_exclusive_scan(s_count + i * R, s_off + i * (R + 1), R, lane);
    __syncthreads();
    for (int i = threadIdx.x; i < nl; i += kThreads) {
      const int le = static_cast<int>(blockIdx.x) + i * G, total = s_off[i * (R + 1) + R];
      s_total[i] = total;
      a.recv_count[le] = total;
      if (a.stats != nullptr) a.stats[le] += total;
    }
    for (int p = threadIdx.x; p < nl * R; p += kThreads) {
      const int i = p / R, s = p % R, le = static_cast<int>(blockIdx.x) + i * G;
      a.layout_range[static_cast<int64_t>(le) * R + s] =
          (static_cast<int64_t>(s_off[i * (R + 1) + s]) << 32) | s_count[p];
    }
    __syncthreads();
    if (warp == 0) warp_exclusive_scan(s_total, s_first, nl, lane);
    __syncthreads();
    // kItems rows at a time: a thread per row reads its header and finds where
    // its bytes are (the source's stage row, or for this rank's own rows in a
    // one-launch BF16/FP16 call, x), then every warp copies (no lookups
    // between a copy's loads).
    const int64_t data_bytes = kFp8 ? H : 2 * H;
    const int64_t per_row = chunks_of(data_bytes);
    const bool from_x = !kFp8 && a.c.phases == kBoth;  // own rows: x is this launch's input
    const int total = s_first[nl];
    for (int base = 0; base < total; base += kItems) {
      const int n = min(kItems, total - base);
      for (int q = threadIdx.x; q < n; q += kThreads) {
        const int g = base + q, i = find_segment(s_first, nl, g);
        const int32_t* off = s_off + i * (R + 1);
        const int r = g - s_first[i], s = find_segment(off, R, r);
        const int le = static_cast<int>(blockIdx.x) + i * G;
        const EpMsgHeader h =
            *reinterpret_cast<const EpMsgHeader*>(own + L.header(seq, le, s, r - off[s]));
        const bool ok = h.local_expert == le && h.token >= 0 && h.token < T && h.topk_slot >= 0 &&
                        h.topk_slot < EpLayout::kMaxTopk &&
                        (s != a.c.rank || h.token < a.num_tokens);
        const int64_t row = le * cols + r;
        a.src_info[row] = ok ? h.token : -1;
        const uint8_t* body = nullptr;
        if (!ok) {
          report(a.c.status, kStatusBadHeader, s, le);
        } else if (s == a.c.rank && from_x) {
          body = static_cast<const uint8_t*>(a.x) + h.token * data_bytes;
        } else {
          body = a.c.peers[s] + L.stage_row(seq, h.token);
        }
        s_src[q] = body;
        s_row[q] = static_cast<int32_t>(row);
      }
      __syncthreads();
      for (int64_t u = warp; u < n * per_row; u += kWarps) {
        const int q = static_cast<int>(u / per_row);
        const uint8_t* body = s_src[q];
        if (body == nullptr) continue;
        const int64_t c = u % per_row, row = s_row[q];
        copy_chunk<true>(static_cast<uint8_t*>(a.recv_x) + row * data_bytes, body, data_bytes, c,
                         lane);
        if constexpr (kFp8) {
          if (c != 0) continue;
          const int64_t nscale = H / EpLayout::kFp8Block;
          for (int64_t j = lane; j < nscale; j += 32)
            a.recv_scales[row * nscale + j] = reinterpret_cast<const float*>(body + H)[j];
        }
      }
      __syncthreads();  // s_src and s_row are refilled next round
    }
    for (int64_t q = threadIdx.x; q < nl * cols; q += kThreads) {
      const int i = static_cast<int>(q / cols);
      const int64_t r = q % cols;
      if (r >= s_total[i]) a.src_info[(blockIdx.x + static_cast<int64_t>(i) * G) * cols + r] = -1;
    }
  }
}

template <typename Elem>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const CombineArgs a) {
  extern __shared__ int32_t s_dyn[];  // send: per (local expert, source) pair: rows, firsts, places
  __shared__ int32_t s_row[kItems];   // send: a row to copy, in x
  __shared__ int32_t s_dst[kItems];   // and in the rows region
  // receive: per token of a batch, its columns' weights and experts, the
  // columns to sum in order, and how many
  __shared__ float s_weight[kBatch][EpLayout::kMaxTopk];
  __shared__ int32_t s_expert[kBatch][EpLayout::kMaxTopk];
  __shared__ int32_t s_slot[kBatch][EpLayout::kMaxTopk];
  __shared__ const uint8_t* s_src[kBatch][EpLayout::kMaxTopk];  // each column's row
  __shared__ int32_t s_used[kBatch];

  const EpLayout& L = a.c.layout;
  const int R = static_cast<int>(L.shape.num_ranks);
  const int E = static_cast<int>(L.shape.num_experts);
  const int epr = static_cast<int>(L.local_experts);
  const int G = static_cast<int>(gridDim.x);
  const int64_t T = L.shape.max_tokens, H = L.shape.hidden;
  const int64_t cols = R * T;
  const int K = a.topk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t seq = a.c.seq;
  const uint32_t tag = static_cast<uint32_t>(seq);
  const bool both = a.c.phases == kBoth;  // split: own rows go through the rows region too
  uint8_t* own = a.c.peers[a.c.rank];
  __shared__ MaskSnapshot s_live;
  s_live.load(a.c, R);
  __syncthreads();

  if (a.c.phases & kSend) {
    // This block serves the pairs p = (local expert, source) = blockIdx.x +
    // i * G: it copies their rows of x into this rank's rows region, where
    // source s's rows of all local experts lie together from row s * E/R * T
    // on (nothing to copy when x is that region: the zero-copy buffer), then
    // raises one flag per pair at the source, carrying the pair's first row
    // in the region.
    const int np = dealt(epr * R);
    int32_t* s_rows = s_dyn;              // [np]: rows to copy
    int32_t* s_first = s_dyn + np;        // [np + 1]
    int32_t* s_start = s_first + np + 1;  // [np]: the pair's first row in x
    int32_t* s_place = s_start + np;      // [np]: and in the rows region
    const bool in_place = a.x == own + L.expert_row(seq, 0);
    // In one launch, this rank's own pairs need nothing copied: the receive
    // phase reads their rows in x.
    for (int i = threadIdx.x; i < np; i += kThreads) {
      const int p = static_cast<int>(blockIdx.x) + i * G, s = p % R;
      const bool copy = !in_place && s_live(a.c, s) && !(both && s == a.c.rank);
      const int64_t whole = a.layout_range[p], range = copy ? whole : 0;
      s_rows[i] = static_cast<int>(range & 0xffffffff);
      s_start[i] = static_cast<int>((p / R) * cols + (range >> 32));
      if (in_place) s_place[i] = static_cast<int>((p / R) * cols + (whole >> 32));
    }
    if (!in_place) {
      // Packed: the pair's rows follow the source's rows of the local experts
      // before it (a warp per pair sums their counts).
      for (int i = warp; i < np; i += kWarps) {
        const int p = static_cast<int>(blockIdx.x) + i * G, le = p / R, s = p % R;
        int before = 0;
        for (int j = lane; j < le; j += 32)
          before += static_cast<int>(a.layout_range[static_cast<int64_t>(j) * R + s] & 0xffffffff);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) before += __shfl_xor_sync(0xffffffffu, before, o);
        if (lane == 0) s_place[i] = static_cast<int>(s * epr * T) + before;
      }
    }
    __syncthreads();
    if (warp == 0) warp_exclusive_scan(s_rows, s_first, np, lane);
    __syncthreads();
    const int total = s_first[np];
    const int64_t per_row = chunks_of(2 * H);
    // kItems rows at a time: a thread per row finds it, then every warp copies.
    for (int base = 0; base < total; base += kItems) {
      const int n = min(kItems, total - base);
      for (int q = threadIdx.x; q < n; q += kThreads) {
        const int g = base + q, i = find_segment(s_first, np, g);
        s_row[q] = s_start[i] + (g - s_first[i]);
        s_dst[q] = s_place[i] + (g - s_first[i]);
      }
      __syncthreads();
      for (int64_t u = warp; u < n * per_row; u += kWarps) {
        const int q = static_cast<int>(u / per_row);
        copy_chunk<false>(own + L.expert_row(seq, s_dst[q]),
                          static_cast<const uint8_t*>(a.x) + static_cast<int64_t>(s_row[q]) * 2 * H,
                          2 * H, u % per_row, lane);
      }
      __syncthreads();  // s_row and s_dst are refilled; the last round: rows before flags
    }
    for (int i = threadIdx.x; i < np; i += kThreads) {
      const int p = static_cast<int>(blockIdx.x) + i * G, le = p / R, s = p % R;
      if (!s_live(a.c, s) || (both && s == a.c.rank)) continue;
      const int64_t range = a.layout_range[p];
      const uint32_t first =
          (range & 0xffffffff) != 0 ? static_cast<uint32_t>(s_place[i]) : EpLayout::kNoRows;
      st_release_sys(
          reinterpret_cast<uint64_t*>(a.c.peers[s] + L.combine_flag(seq, a.c.rank * epr + le)),
          (seq << 32) | first);
    }
  }

  if (a.c.phases & kRecv) {
    // This block sums tokens blockIdx.x + i * G, kBatch at a time: a thread
    // per (token, column) finds its expert output (waiting for the expert's
    // flag, which says where the expert's rows for this rank start; the
    // dispatch recorded the slot), a thread per token orders its columns,
    // then every thread sums (token, 8 channels) units, reading the rows
    // where the experts' owners keep them. One set of barriers per batch, not
    // per token: with several ranks on a GPU a block holds several tokens,
    // and their waits and sorts run side by side.
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    const int nt = dealt(static_cast<int>(a.num_tokens));
    const int64_t vecs = H / 8;
    for (int b0 = 0; b0 < nt; b0 += kBatch) {
      const int nb = min(kBatch, nt - b0);
      for (int q = threadIdx.x; q < nb * K; q += kThreads) {
        const int i = q / K, k = q % K;
        const int64_t t = blockIdx.x + static_cast<int64_t>(b0 + i) * G;
        const int64_t e = load_idx(a.topk_idx, t * K + k, a.topk_int64);
        bool used = false;
        const uint8_t* src = nullptr;
        if (e >= 0 && e < E) {
          const int d = static_cast<int>(e / epr), le = static_cast<int>(e % epr);
          // The slot this selection took at its expert (an entry of another
          // call: it was not delivered).
          const uint64_t at = *reinterpret_cast<const uint64_t*>(own + L.combine_index(seq, t, k));
          const bool sent = (at >> 32) == tag;
          const int64_t slot = static_cast<int64_t>(at & 0xffffffffu);
          if (!s_live(a.c, d)) {
          } else if (both && d == a.c.rank) {
            // This rank's own expert: its output is in x, where the dispatch put the row.
            const int64_t range = a.layout_range[static_cast<int64_t>(le) * R + a.c.rank];
            used = sent && slot < (range & 0xffffffff);
            src = static_cast<const uint8_t*>(a.x) + (le * cols + (range >> 32) + slot) * 2 * H;
          } else {
            uint64_t v = 0;
            const auto* flag = reinterpret_cast<const uint64_t*>(own + L.combine_flag(seq, e));
            const auto ready = [tag](uint64_t x) { return (x >> 32) == tag; };
            if (wait_for(a.c, flag, ready, deadline, d, kRecv, &v)) {
              const uint32_t first = static_cast<uint32_t>(v);
              used = sent && first != EpLayout::kNoRows && first + slot < epr * cols;
              src = a.c.peers[d] + L.expert_row(seq, first + slot);
            }
          }
        }
        s_expert[i][k] = used ? static_cast<int>(e) : -1;
        s_src[i][k] = src;
        s_weight[i][k] = a.topk_weights[t * K + k];
      }
      __syncthreads();
      for (int i = threadIdx.x; i < nb; i += kThreads) {
        // Ascending expert, then column: the portable path's summation order.
        const int32_t* expert = s_expert[i];
        int32_t* slot = s_slot[i];
        int n = 0;
        for (int k = 0; k < K; ++k) {
          if (expert[k] < 0) continue;
          int at = n++;
          while (at > 0 && expert[slot[at - 1]] > expert[k]) {
            slot[at] = slot[at - 1];
            --at;
          }
          slot[at] = k;
        }
        s_used[i] = n;
      }
      __syncthreads();
      for (int64_t u = threadIdx.x; u < nb * vecs; u += kThreads) {
        const int i = static_cast<int>(u / vecs);
        const int64_t v = u % vecs, t = blockIdx.x + static_cast<int64_t>(b0 + i) * G;
        const int n = s_used[i];
        const int32_t* slot = s_slot[i];
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        // kLoads rows' loads in flight at once; the sums stay in order.
        for (int i0 = 0; i0 < n; i0 += kLoads) {
          int4 raw[kLoads];
#pragma unroll
          for (int q = 0; q < kLoads; ++q)
            if (i0 + q < n) raw[q] = reinterpret_cast<const int4*>(s_src[i][slot[i0 + q]])[v];
#pragma unroll
          for (int q = 0; q < kLoads; ++q) {
            if (i0 + q >= n) break;
            const float w = s_weight[i][slot[i0 + q]];
            float f[8];
            to_float8<Elem>(raw[q], f);
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(f[c], w));
          }
        }
        reinterpret_cast<int4*>(static_cast<Elem*>(a.out) + t * H)[v] = from_float8<Elem>(acc);
      }
      __syncthreads();  // the batch's shared selections are refilled for the next
    }
  }
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw_error(ErrorKind::kSystem, -1, what, ": kernel launch failed: ", cudaGetErrorString(err));
}

// Blocks get work round-robin, so each holds at most ceil(n / grid) of n things.
int64_t per_block(int64_t n, int64_t grid) {
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

template <typename T, bool kFp8>
void dispatch_as(const DispatchArgs& a, cudaStream_t stream) {
  const EpShape& s = a.c.layout.shape;
  const int64_t nb = per_block(s.num_experts, a.c.num_blocks);
  const int64_t nl = per_block(a.c.layout.local_experts, a.c.num_blocks);
  const size_t smem = sizeof(int32_t) * std::max(nb * (kWarps + 1), nl * (2 * s.num_ranks + 3) + 1);
  allow_smem(dispatch_kernel<T, kFp8>, smem, "dispatch");
  dispatch_kernel<T, kFp8><<<a.c.num_blocks, kThreads, smem, stream>>>(a);
}

}  // namespace

void launch_dispatch(const DispatchArgs& a, CUstream_st* stream) {
  // A bound from when the last warp ran a scan beside the send phase's per-expert
  // sums; that scan went with the pulled rows, but lifting the bound wants a GPU run.
  MC_CHECK_ARG(per_block(a.c.layout.shape.num_experts, a.c.num_blocks) <= kThreads - 32,
               "dispatch: ", a.c.layout.shape.num_experts, " experts over ", a.c.num_blocks,
               " blocks: at most ", kThreads - 32, " experts per block");
  if (a.x_dtype == Dtype::kBf16)
    a.use_fp8 ? dispatch_as<__nv_bfloat16, true>(a, stream)
              : dispatch_as<__nv_bfloat16, false>(a, stream);
  else
    a.use_fp8 ? dispatch_as<__half, true>(a, stream) : dispatch_as<__half, false>(a, stream);
  check_launch("dispatch");
}

void launch_combine(const CombineArgs& a, CUstream_st* stream) {
  const int64_t np = per_block(a.c.layout.shape.num_experts, a.c.num_blocks);  // E/R * R pairs
  const size_t smem = sizeof(int32_t) * (4 * np + 1);
  if (a.x_dtype == Dtype::kBf16) {
    allow_smem(combine_kernel<__nv_bfloat16>, smem, "combine");
    combine_kernel<__nv_bfloat16><<<a.c.num_blocks, kThreads, smem, stream>>>(a);
  } else {
    allow_smem(combine_kernel<__half>, smem, "combine");
    combine_kernel<__half><<<a.c.num_blocks, kThreads, smem, stream>>>(a);
  }
  check_launch("combine");
}

}  // namespace mooncake::kernels
