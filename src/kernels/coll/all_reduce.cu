// launch_direct_all_reduce (coll/direct.h, which says what a launch does and
// why each rank's area can be reused without a wait at the end). The
// arithmetic is coll/reduce.cuh's, sources in rank order: the host-driven
// plane's and the host's results, bit for bit.
//
// Memory order: the copies of step 1 (every block) reach block 0 through the
// grid barrier, which block 0 follows with a system-scope fence and the
// release of its signal; a peer acquires the signal (system scope) before it
// reads this rank's area, and passes the decision to its other blocks through
// its own grid barrier. Data another rank stores during the launch is read
// with plain loads, never the read-only path.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/coll/direct.h"
#include "kernels/coll/reduce.cuh"
#include "kernels/common/grid.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"

namespace mooncake::kernels {
namespace {

// Wait phases, as the silent-peer reports name them.
constexpr int kPhaseInput = 1;
constexpr int kPhaseShare = 2;

// Elements [lo, hi).
struct Span {
  size_t lo, hi;
};

// This block's part of [first, last): whole units of `unit` elements (the
// last part ends at `last`).
__device__ __forceinline__ Span block_part(size_t first, size_t last, size_t unit) {
  const size_t n = last > first ? last - first : 0;
  const size_t units = (n + unit - 1) / unit;
  const size_t per = (units + gridDim.x - 1) / gridDim.x * unit;
  const size_t lo = first + static_cast<size_t>(blockIdx.x) * per;
  return lo >= last ? Span{last, last} : Span{lo, lo + per < last ? lo + per : last};
}

// Share `j` of a two-shot op: direct_share_elems elements from j's first.
__device__ __forceinline__ Span share_of(int j, size_t count, size_t per) {
  const size_t lo = static_cast<size_t>(j) * per;
  return lo >= count ? Span{count, count} : Span{lo, lo + per < count ? lo + per : count};
}

// Step 1: this block's part of the input's bytes into the area.
__device__ void copy_in(uint8_t* dst, const uint8_t* src, size_t bytes, bool vec) {
  const Span p = block_part(0, bytes, 16);
  size_t i = p.lo + threadIdx.x * 16;
  if (vec) {
    for (; i + 16 <= p.hi; i += blockDim.x * 16)
      *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
    if (i < p.hi)  // the input's last, partial vector
      for (size_t b = i; b < p.hi; ++b) dst[b] = src[b];
    return;
  }
  for (size_t b = p.lo + threadIdx.x; b < p.hi; b += blockDim.x) dst[b] = src[b];
}

// Elements [s.lo, s.hi) reduced from `n` sources (`srcs[k] + at` bytes are
// their element arrays) into out[i], and into also[i - also_first] when
// given. With `vec`, s.lo and also_first are whole vectors and every pointer
// is 16-byte aligned.
template <typename T, RedOp Op>
__device__ void reduce_span(const uint8_t* const* srcs, int n, size_t at, Span s, T* out, T* also,
                            size_t also_first, bool vec) {
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  size_t done = s.lo;
  if (vec) {
    const size_t first = s.lo / V, last = s.hi / V;
    auto vsrc = [&](int k) { return reinterpret_cast<const uint4*>(srcs[k] + at); };
    for (size_t i = first + threadIdx.x; i < last; i += blockDim.x) {
      const uint4 r = reduce_vector<T, Op>(vsrc, n, i, n);
      reinterpret_cast<uint4*>(out)[i] = r;
      if (also != nullptr) reinterpret_cast<uint4*>(also)[i - also_first / V] = r;
    }
    done = last * V > s.lo ? last * V : s.lo;
  }
  auto src = [&](int k) { return reinterpret_cast<const T*>(srcs[k] + at); };
  for (size_t i = done + threadIdx.x; i < s.hi; i += blockDim.x) {
    const T r = reduce_element<T, Op>(src, n, i, n);
    out[i] = r;
    if (also != nullptr) also[i - also_first] = r;
  }
}

// Elements [s.lo, s.hi) of out from `from`, which holds the elements from `first` on.
template <typename T>
__device__ void copy_span(const uint8_t* from, size_t first, Span s, T* out, bool vec) {
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  const T* f = reinterpret_cast<const T*>(from);
  size_t done = s.lo;
  if (vec) {
    const size_t lo = s.lo / V, hi = s.hi / V;
    for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
      reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(f)[i - first / V];
    done = hi * V > s.lo ? hi * V : s.lo;
  }
  for (size_t i = done + threadIdx.x; i < s.hi; i += blockDim.x) out[i] = f[i - first];
}

// A peer masked during this launch: the caller's active_ranks say so too.
__device__ __forceinline__ void report_masked(DirectState* st, int j) {
  if (st->report != nullptr) *reinterpret_cast<volatile int32_t*>(st->report + j) = 0;
}

// Step 2, for rank j (a thread each): whether it takes part in op `seq`.
__device__ int32_t decide(const DirectArgs& a, DirectState* st, int j, uint64_t seq, uint32_t gen,
                          uint64_t deadline) {
  if (j == st->rank) return a.shape != kShapeRejected ? 1 : 0;
  // Masked by an earlier launch (or retired by the host): out until the next setup.
  if (ld_volatile(st->live + j) == 0) return 0;
  const uint8_t* area = st->areas[j];
  if (area == nullptr) return 0;
  const auto* signal = reinterpret_cast<const uint64_t*>(area + DirectLayout::kInputSignal);
  const auto settled = [gen, seq](uint64_t v) { return tag_settled(v, gen, seq); };
  uint64_t v = 0;
  if (!wait_for(a.c, signal, settled, deadline, j, kPhaseInput, &v)) {
    // Masked now (lost, or past the deadline): its input is in place all the
    // same when its signal came just before (a dead process's area stays
    // readable), and then every survivor takes it, as this look shows.
    v = ld_acquire_sys(signal);
    if (!settled(v)) {
      report_masked(st, j);
      return 0;
    }
  }
  if (a.shape == kShapeRejected) return 0;  // this rank only takes part
  if (tag_gen(v) != gen || tag_ahead(v, seq) > 1) {
    report(a.c.status, kStatusDirectStale, j, static_cast<int>(tag_gen(v)));
    return 0;
  }
  const uint64_t shape =
      *reinterpret_cast<const volatile uint64_t*>(area + DirectLayout::shape(seq));
  if (shape == a.shape) return 1;
  report(a.c.status, shape == kShapeRejected ? kStatusDirectRejected : kStatusDirectMismatch, j, 0);
  return 0;
}

// Whether rank j's two-shot share of op `seq` is in its area (else this
// block reduces that share itself: same sources, same bits).
__device__ bool share_arrived(const DirectArgs& a, DirectState* st, int j, uint64_t seq,
                              uint32_t gen, uint64_t deadline) {
  if (ld_volatile(st->live + j) == 0) return false;
  const auto* signal = reinterpret_cast<const uint64_t*>(st->areas[j] + DirectLayout::kShareSignal);
  const auto settled = [gen, seq](uint64_t v) { return tag_settled(v, gen, seq); };
  uint64_t v = 0;
  if (!wait_for(a.c, signal, settled, deadline, j, kPhaseShare, &v)) {
    report_masked(st, j);
    return false;
  }
  return tag_gen(v) == gen && tag_ahead(v, seq) <= 1;
}

template <typename T, RedOp Op>
__global__ void __launch_bounds__(kDirectThreads) direct_all_reduce(DirectArgs a) {
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  DirectState* st = a.state;
  __shared__ uint64_t s_seq;
  __shared__ uint32_t s_gen;
  __shared__ int s_n;
  __shared__ int s_ok;
  __shared__ const uint8_t* s_src[kDirectMaxRanks];
  __shared__ int32_t s_in[kDirectMaxRanks];
  if (threadIdx.x == 0) {
    s_seq = *reinterpret_cast<volatile uint64_t*>(&st->seq) + 1;
    s_gen = st->gen;
  }
  __syncthreads();
  const uint64_t seq = s_seq;
  const uint32_t gen = s_gen;
  const int R = st->ranks, me = st->rank;
  const DirectLayout& L = a.layout;
  uint8_t* own = st->areas[me];
  const bool multi = gridDim.x > 1;
  const size_t unit = a.vec ? V : 1;

  const bool data = a.shape != kShapeRejected;

  // 1. The input into this rank's area.
  if (data)
    copy_in(own + L.input(seq), static_cast<const uint8_t*>(a.in), a.count * sizeof(T), a.vec);
  __syncthreads();
  uint32_t bar = 0;
  if (multi && threadIdx.x == 0) bar = grid_arrive(st->grid_sync);

  // 2. Block 0 publishes, then decides who takes part.
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      if (multi) grid_wait(st->grid_sync, bar, a.c.timeout_ns, a.c.status);
      *reinterpret_cast<volatile uint64_t*>(&st->seq) = seq;  // every block has read it
      *reinterpret_cast<volatile uint64_t*>(own + DirectLayout::shape(seq)) = a.shape;
      __threadfence_system();
      st_release_sys(reinterpret_cast<uint64_t*>(own + DirectLayout::kInputSignal),
                     direct_tag(gen, seq));
    }
    __syncthreads();
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    for (int j = threadIdx.x; j < R; j += blockDim.x)
      st->sources[j] = decide(a, st, j, seq, gen, deadline);
    __syncthreads();
  }
  if (multi && threadIdx.x == 0) {
    if (blockIdx.x != 0) grid_wait(st->grid_sync, bar, a.c.timeout_ns, a.c.status);
    const uint32_t bar2 = grid_arrive(st->grid_sync);
    // Block 0 arrives once its waits are over: up to the whole budget.
    grid_wait(st->grid_sync, bar2, 2 * a.c.timeout_ns + 1000000000, a.c.status);
  }
  if (threadIdx.x == 0) {
    int n = 0;
    for (int j = 0; j < R; ++j) {
      s_in[j] = ld_volatile(st->sources + j);
      if (s_in[j] != 0) s_src[n++] = st->areas[j];
    }
    s_n = n;
  }
  __syncthreads();
  const int n = s_n;
  if (!data || n == 0) return;  // a rejected call only takes part
  T* out = static_cast<T*>(a.out);

  // 3. One-shot: every element from every source.
  if (!a.two_shot) {
    reduce_span<T, Op>(s_src, n, L.input(seq), block_part(0, a.count, unit), out, nullptr, 0,
                       a.vec);
    return;
  }

  // 3. Two-shot: this rank's share, into its area and the output...
  const size_t per = direct_share_elems(a.count, R, sizeof(T));
  const Span mine = share_of(me, a.count, per);
  reduce_span<T, Op>(s_src, n, L.input(seq), block_part(mine.lo, mine.hi, unit), out,
                     reinterpret_cast<T*>(own + L.share(seq)), mine.lo, a.vec);
  __syncthreads();
  uint32_t bar3 = 0;
  if (multi && threadIdx.x == 0) bar3 = grid_arrive(st->grid_sync);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (multi) grid_wait(st->grid_sync, bar3, a.c.timeout_ns, a.c.status);
    __threadfence_system();
    st_release_sys(reinterpret_cast<uint64_t*>(own + DirectLayout::kShareSignal),
                   direct_tag(gen, seq));
  }
  // ...then every other share: from its owner's area where it came, else
  // reduced here from the sources, which are all still in place.
  __shared__ uint64_t s_deadline;
  if (threadIdx.x == 0) s_deadline = deadline_of(a.c.timeout_ns);
  for (int j = 0; j < R; ++j) {
    if (j == me) continue;
    const Span share = share_of(j, a.count, per);
    const Span part = block_part(share.lo, share.hi, unit);
    if (part.lo >= part.hi) continue;  // the same for every thread of the block
    __syncthreads();                   // s_ok's last use is over
    if (threadIdx.x == 0) s_ok = s_in[j] != 0 && share_arrived(a, st, j, seq, gen, s_deadline);
    __syncthreads();
    if (s_ok)
      copy_span<T>(st->areas[j] + L.share(seq), share.lo, part, out, a.vec);
    else
      reduce_span<T, Op>(s_src, n, L.input(seq), part, out, nullptr, 0, a.vec);
  }
}

}  // namespace

int launch_direct_all_reduce(const DirectArgs& a, int blocks, CUstream_st* stream) {
  if (blocks < 1 || blocks > kDirectMaxBlocks) return static_cast<int>(cudaErrorInvalidValue);
  return with_dtype_op(a.dtype, a.op, [&]<typename T, RedOp Op>() {
    direct_all_reduce<T, Op><<<static_cast<unsigned>(blocks), kDirectThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace mooncake::kernels
