// EP dispatch and combine on the GPU, over workspaces every rank maps
// (api.h says what the phases, signals and status mean; ep/layout.h where
// everything lives).
//
// Dispatch, send phase: one block per global expert e (grid-stride). The block
// scans topk_idx in flat order, gives each selection of e the next slot (so a
// source's rows reach the receiver in token order, as the portable path
// orders them), and a warp per selection stores header + payload (BF16/FP16,
// or FP8 quantised in registers) into the owner's [local expert][this rank]
// slots. Then it publishes the count with a system-scope release.
// Receive phase: one block per local expert waits for the R counts (a thread
// per source, each with the phase's deadline), lays the sources out in rank
// order and unpacks the messages into recv_x, src_info and layout_range.
//
// Combine, send phase: one block per (local expert, source) pair stores each
// received row's expert output into the source's [token][top-k column] row
// and raises that source's flag for this expert. Receive phase: one block per
// token waits for the flags of its selected experts and sums weight * row in
// fp32, in ascending expert order (the portable path's order, so the result
// is bit-identical), rounded once.
//
// Blocks never wait on blocks that have not started: every block does its
// send work before it waits, and the grid is at most as large as what is
// resident at once (the host sizes it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

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
__device__ bool wait_for(const uint64_t* signal, Ready ready, uint64_t deadline, int32_t* active,
                         int source, int32_t* status, int phase, uint64_t* value) {
  while (true) {
    const uint64_t v = ld_acquire_sys(signal);
    if (ready(v)) {
      *value = v;
      return true;
    }
    if (ld_volatile(active + source) == 0) return false;
    if (now_ns() > deadline) {
      if (atomicExch(active + source, 0) != 0) {
        report(status, kStatusSilentPeer, source, phase);
        volatile int32_t* timeouts = status + 3;
        *timeouts = *timeouts + 1;
      }
      return false;
    }
    __nanosleep(100);
  }
}

template <typename T>
__device__ __forceinline__ void to_float8(const int4& v, float (&f)[8]);
template <>
__device__ __forceinline__ void to_float8<__nv_bfloat16>(const int4& v, float (&f)[8]) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}
template <>
__device__ __forceinline__ void to_float8<__half>(const int4& v, float (&f)[8]) {
  const auto* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ int4 from_float8(const float (&f)[8]);
template <>
__device__ __forceinline__ int4 from_float8<__nv_bfloat16>(const float (&f)[8]) {
  int4 v;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}
template <>
__device__ __forceinline__ int4 from_float8<__half>(const float (&f)[8]) {
  int4 v;
  auto* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// Rows move in chunks of kChunkBytes, a warp per chunk (four 16-byte loads
// in flight per lane), so that a few rows still spread over every warp.
constexpr int64_t kChunkBytes = 32 * 4 * 16;

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
  int4 v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t i = first + 32 * j;
    if (i < n) v[j] = kFresh ? s[i] : __ldg(s + i);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
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

// FP8: this rank's tokens quantised once into its stage rows (data, then
// scales), which the dispatch kernel then copies to every selected expert.
template <typename Elem>
__global__ void __launch_bounds__(kThreads, 1) quantize_kernel(const DispatchArgs a) {
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

template <typename Elem, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchArgs a) {
  extern __shared__ int32_t s_dyn[];  // counts [R] and offsets [R + 1]
  __shared__ int32_t s_items[kThreads];
  __shared__ int32_t s_warp_base[kWarps];
  __shared__ int32_t s_matches;

  const EpLayout& L = a.c.layout;
  const int R = static_cast<int>(L.shape.num_ranks);
  const int E = static_cast<int>(L.shape.num_experts);
  const int epr = static_cast<int>(L.local_experts);
  const int64_t T = L.shape.max_tokens, H = L.shape.hidden;
  const int K = a.topk;
  const int64_t entries = a.num_tokens * K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t seq = a.c.seq;

  // The bytes after a header: BF16/FP16 rows, or FP8 data and scales (from
  // the stage, padded to 16 bytes; the message slot has room for them).
  const int64_t body_bytes = kFp8 ? (H + 4 * (H / 128) + 15) / 16 * 16 : 2 * H;
  const int64_t per_row = chunks_of(body_bytes);
  const uint8_t* stage = a.c.peers[a.c.rank];

  if (a.c.phases & kSend) {
    for (int e = blockIdx.x; e < E; e += gridDim.x) {
      const int dest = e / epr, le = e % epr;
      uint8_t* ws = a.c.peers[dest];
      int rows = 0;
      if (ld_volatile(a.c.active_ranks + dest) != 0) {
        for (int64_t base = 0; base < entries; base += kThreads) {
          const int64_t j = base + threadIdx.x;
          bool match = false;
          if (j < entries) {
            const int64_t id = load_idx(a.topk_idx, j, a.topk_int64);
            match = id == e;
            if (e == 0 && (id < -1 || id >= E))
              report(a.c.status, kStatusBadExpert, static_cast<int>(id), static_cast<int>(j / K));
          }
          // Slots in flat order: a block-wide exclusive scan of the matches.
          const unsigned ballot = __ballot_sync(0xffffffffu, match);
          if (lane == 0) s_warp_base[warp] = __popc(ballot);
          __syncthreads();
          if (warp == 0) {
            const int c = lane < kWarps ? s_warp_base[lane] : 0;
            int incl = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
              const int y = __shfl_up_sync(0xffffffffu, incl, o);
              if (lane >= o) incl += y;
            }
            if (lane < kWarps) s_warp_base[lane] = incl - c;
            if (lane == 31) s_matches = incl;
          }
          __syncthreads();
          if (match)
            s_items[s_warp_base[warp] + __popc(ballot & ((1u << lane) - 1))] = static_cast<int>(j);
          __syncthreads();
          const int n = s_matches;
          // A warp per (row, chunk): every warp has work even for a few rows.
          for (int64_t u = warp; u < n * per_row; u += kWarps) {
            const int i = static_cast<int>(u / per_row);
            const int64_t c = u % per_row;
            const int slot = rows + i;
            if (slot >= T) {
              if (c == 0 && lane == 0) report(a.c.status, kStatusOverflow, e, slot + 1);
              continue;
            }
            const int flat = s_items[i];
            const int t = flat / K, k = flat % K;
            uint8_t* msg = ws + L.dispatch_msg(seq, le, a.c.rank, slot);
            if (c == 0 && lane == 0)
              *reinterpret_cast<EpMsgHeader*>(msg) = EpMsgHeader{t, le, k, 0};
            const uint8_t* row =
                kFp8 ? stage + L.stage_row(seq, t) : static_cast<const uint8_t*>(a.x) + t * 2 * H;
            copy_chunk<false>(msg + EpLayout::kHeaderBytes, row, body_bytes, c, lane);
          }
          rows += n;
          __syncthreads();  // s_items is refilled next round
        }
      }
      const uint64_t count = static_cast<uint64_t>(rows < T ? rows : T);
      // This rank's flag for e in this half is next raised by e's owner in the
      // combine of this call, which follows the count below: clear it now.
      if (threadIdx.x == 0)
        *reinterpret_cast<uint64_t*>(a.c.peers[a.c.rank] + L.combine_flag(seq, e)) = 0;
      // Every thread's stores, then the count: the barrier orders them before
      // thread 0's release, which is cumulative (it publishes what it has seen).
      __syncthreads();
      if (threadIdx.x == 0)
        st_release_sys(reinterpret_cast<uint64_t*>(ws + L.dispatch_count(seq, le, a.c.rank)),
                       (seq << 32) | count);
    }
  }

  if (a.c.phases & kRecv) {
    int32_t* s_count = s_dyn;
    int32_t* s_off = s_dyn + R;
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    uint8_t* own = a.c.peers[a.c.rank];
    const int64_t cols = R * T;
    for (int le = blockIdx.x; le < epr; le += gridDim.x) {
      for (int s = threadIdx.x; s < R; s += kThreads) {
        uint64_t v = 0;
        int count = 0;
        const auto* sig = reinterpret_cast<const uint64_t*>(own + L.dispatch_count(seq, le, s));
        const auto ready = [seq](uint64_t x) { return (x >> 32) == (seq & 0xffffffffu); };
        if (ld_volatile(a.c.active_ranks + s) != 0 &&
            wait_for(sig, ready, deadline, a.c.active_ranks, s, a.c.status, kRecv, &v)) {
          // Consumed: cleared, so a replay of a captured graph (the same
          // sequence number again) waits for the new count.
          *const_cast<uint64_t*>(sig) = 0;
          count = static_cast<int>(v & 0xffffffffu);
          if (count > T) {
            report(a.c.status, kStatusBadCount, s, count);
            count = 0;
          }
        }
        s_count[s] = count;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int at = 0;
        for (int s = 0; s < R; ++s) {
          s_off[s] = at;
          at += s_count[s];
        }
        s_off[R] = at;
        a.recv_count[le] = at;
        if (a.stats != nullptr) a.stats[le] += at;
      }
      __syncthreads();
      for (int s = threadIdx.x; s < R; s += kThreads)
        a.layout_range[static_cast<int64_t>(le) * R + s] =
            (static_cast<int64_t>(s_off[s]) << 32) | s_count[s];
      const int total = s_off[R];
      const int64_t data_bytes = kFp8 ? H : 2 * H;
      const int64_t per_row = chunks_of(data_bytes);
      for (int64_t u = warp; u < total * per_row; u += kWarps) {
        const int i = static_cast<int>(u / per_row);
        const int64_t c = u % per_row;
        int lo = 0, hi = R - 1;  // the source whose rows hold i
        while (lo < hi) {
          const int mid = (lo + hi + 1) / 2;
          if (s_off[mid] <= i)
            lo = mid;
          else
            hi = mid - 1;
        }
        const int s = lo;
        const uint8_t* msg = own + L.dispatch_msg(seq, le, s, i - s_off[s]);
        const uint8_t* body = msg + EpLayout::kHeaderBytes;
        const int64_t row = le * cols + i;
        copy_chunk<true>(static_cast<uint8_t*>(a.recv_x) + row * data_bytes, body, data_bytes, c,
                         lane);
        if (c != 0) continue;
        const EpMsgHeader h = *reinterpret_cast<const EpMsgHeader*>(msg);
        const bool ok = h.local_expert == le && h.token >= 0 && h.token < T && h.topk_slot >= 0 &&
                        h.topk_slot < EpLayout::kMaxTopk;
        if (lane == 0) {
          a.src_info[row] = ok ? h.token : -1;
          a.src_slot[row] = ok ? h.topk_slot : 0;
          if (!ok) report(a.c.status, kStatusBadHeader, s, le);
        }
        if constexpr (kFp8) {
          const int64_t nscale = H / 128;
          for (int64_t j = lane; j < nscale; j += 32)
            a.recv_scales[row * nscale + j] = reinterpret_cast<const float*>(body + H)[j];
        }
      }
      for (int64_t i = total + threadIdx.x; i < cols; i += kThreads) a.src_info[le * cols + i] = -1;
      __syncthreads();  // s_count and s_off are refilled for the next expert
    }
  }
}

template <typename Elem>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const CombineArgs a) {
  __shared__ float s_weight[EpLayout::kMaxTopk];
  __shared__ int32_t s_slot[EpLayout::kMaxTopk];
  __shared__ int32_t s_expert[EpLayout::kMaxTopk];
  __shared__ int32_t s_used;

  const EpLayout& L = a.c.layout;
  const int R = static_cast<int>(L.shape.num_ranks);
  const int E = static_cast<int>(L.shape.num_experts);
  const int epr = static_cast<int>(L.local_experts);
  const int64_t T = L.shape.max_tokens, H = L.shape.hidden;
  const int64_t cols = R * T;
  const int K = a.topk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t seq = a.c.seq;

  if (a.c.phases & kSend) {
    for (int p = blockIdx.x; p < epr * R; p += gridDim.x) {
      const int le = p / R, s = p % R;
      uint8_t* ws = a.c.peers[s];
      const int64_t range = a.layout_range[p];
      const int off = static_cast<int>(range >> 32), count = static_cast<int>(range & 0xffffffff);
      if (ld_volatile(a.c.active_ranks + s) != 0) {
        const int64_t per_row = chunks_of(2 * H);
        for (int64_t u = warp; u < count * per_row; u += kWarps) {
          const int64_t row = le * cols + off + u / per_row;
          const int t = a.src_info[row], k = a.src_slot[row];
          if (t < 0 || t >= T || k < 0 || k >= EpLayout::kMaxTopk) continue;
          copy_chunk<false>(ws + L.combine_row(seq, t, k),
                            static_cast<const uint8_t*>(a.x) + row * 2 * H, 2 * H, u % per_row,
                            lane);
        }
      }
      __syncthreads();  // the rows, then the flag (as dispatch publishes its counts)
      if (threadIdx.x == 0)
        st_release_sys(reinterpret_cast<uint64_t*>(ws + L.combine_flag(seq, a.c.rank * epr + le)),
                       seq);
    }
  }

  if (a.c.phases & kRecv) {
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    const uint8_t* own = a.c.peers[a.c.rank];
    for (int64_t t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
      if (threadIdx.x < K) {
        const int k = threadIdx.x;
        const int64_t e = load_idx(a.topk_idx, t * K + k, a.topk_int64);
        bool used = false;
        if (e >= 0 && e < E) {
          const int d = static_cast<int>(e / epr);
          uint64_t v = 0;
          const auto* flag = reinterpret_cast<const uint64_t*>(own + L.combine_flag(seq, e));
          const auto ready = [seq](uint64_t x) { return x == seq; };
          used = ld_volatile(a.c.active_ranks + d) != 0 &&
                 wait_for(flag, ready, deadline, a.c.active_ranks, d, a.c.status, kRecv, &v);
        }
        s_expert[k] = used ? static_cast<int>(e) : -1;
        s_weight[k] = a.topk_weights[t * K + k];
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        // Ascending expert, then column: the portable path's summation order.
        int n = 0;
        for (int k = 0; k < K; ++k) {
          if (s_expert[k] < 0) continue;
          int at = n++;
          while (at > 0 && s_expert[s_slot[at - 1]] > s_expert[k]) {
            s_slot[at] = s_slot[at - 1];
            --at;
          }
          s_slot[at] = k;
        }
        s_used = n;
      }
      __syncthreads();
      const int n = s_used;
      const int64_t vecs = H / 8;
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < n; ++i) {
          const int k = s_slot[i];
          const float w = s_weight[k];
          const int4 raw = reinterpret_cast<const int4*>(own + L.combine_row(seq, t, k))[v];
          float f[8];
          to_float8<Elem>(raw, f);
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(f[c], w));
        }
        reinterpret_cast<int4*>(static_cast<Elem*>(a.out) + t * H)[v] = from_float8<Elem>(acc);
      }
      __syncthreads();  // the shared selection is refilled for the next token
    }
  }
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw_error(ErrorKind::kSystem, -1, what, ": kernel launch failed: ", cudaGetErrorString(err));
}

template <typename T>
void dispatch_as(const DispatchArgs& a, cudaStream_t stream) {
  const size_t smem = (2 * a.c.layout.shape.num_ranks + 1) * sizeof(int32_t);
  if (a.use_fp8 && (a.c.phases & kSend) && a.num_tokens > 0)
    quantize_kernel<T><<<a.c.num_blocks, kThreads, 0, stream>>>(a);
  if (a.use_fp8)
    dispatch_kernel<T, true><<<a.c.num_blocks, kThreads, smem, stream>>>(a);
  else
    dispatch_kernel<T, false><<<a.c.num_blocks, kThreads, smem, stream>>>(a);
}

}  // namespace

void launch_dispatch(const DispatchArgs& a, CUstream_st* stream) {
  if (a.x_dtype == Dtype::kBf16)
    dispatch_as<__nv_bfloat16>(a, stream);
  else
    dispatch_as<__half>(a, stream);
  check_launch("dispatch");
}

void launch_combine(const CombineArgs& a, CUstream_st* stream) {
  if (a.x_dtype == Dtype::kBf16)
    combine_kernel<__nv_bfloat16><<<a.c.num_blocks, kThreads, 0, stream>>>(a);
  else
    combine_kernel<__half><<<a.c.num_blocks, kThreads, 0, stream>>>(a);
  check_launch("combine");
}

}  // namespace mooncake::kernels
