// The kernel of launch_direct (coll/direct.h, which says what a launch does
// and why each rank's area can be reused without a wait at the end). The arithmetic is
// coll/reduce.cuh's, sources in rank order: the host-driven plane's and the
// host's results, bit for bit. The kinds that only move data run as bytes
// (one instantiation for every dtype); the reductions per dtype and op.
//
// Memory order: the copies of step 1 (every block) reach block 0 through the
// grid barrier, which block 0 follows with a system-scope fence and the
// release of its signal; a peer acquires the signal (system scope) before it
// reads this rank's area, and passes the decision to its other blocks through
// its own grid barrier. Data another rank stores during the launch is read
// with plain loads, never the read-only path.
//
// A header of the kernel and its helpers, in an anonymous namespace: each
// coll/direct_*.cu instantiates a few of the dtypes (direct_parts.h), so that
// a build compiles them in parallel (in one file they took a cold build's
// longest step).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/coll/direct.h"
#include "kernels/coll/direct_parts.h"
#include "kernels/coll/reduce.cuh"
#include "kernels/common/grid.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"

namespace mooncake::kernels {
namespace {

// Wait phases, as the silent-peer reports name them.
constexpr int kPhaseInput = 1;
constexpr int kPhaseShare = 2;
constexpr int kPhaseMapped = 3;
constexpr int kPhaseVary = 4;

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

// Vectors a thread moves per round of the copy and reduction loops, every
// load of a round issued before any store: a launch has few threads (a
// process's share of the GPU, at most kDirectMaxBlocks blocks), and with one
// load in flight each they wait on memory most of the time (the EP kernels'
// copies found the same: kernels/common/copy.cuh).
constexpr int kUnroll = 4;

// Vectors [0, n) of out from in: the block's thread t takes t, t + blockDim.x, ...,
// kUnroll of them a round.
__device__ void copy_vectors(uint4* out, const uint4* in, size_t n) {
  const size_t step = blockDim.x;
  size_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * step < n; i += kUnroll * step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = in[i + u * step];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) out[i + u * step] = v[u];
  }
  for (; i < n; i += step) out[i] = in[i];
}

// Step 1: this block's part of the input's bytes into the area.
__device__ void copy_in(uint8_t* dst, const uint8_t* src, size_t bytes, bool vec) {
  const Span p = block_part(0, bytes, 16);
  if (vec) {
    const size_t n = (p.hi - p.lo) / 16;  // whole vectors (p.lo is one)
    copy_vectors(reinterpret_cast<uint4*>(dst + p.lo), reinterpret_cast<const uint4*>(src + p.lo),
                 n);
    if (threadIdx.x == 0)  // the input's last, partial vector
      for (size_t b = p.lo + n * 16; b < p.hi; ++b) dst[b] = src[b];
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
    const size_t first = s.lo / V, last = s.hi / V, step = blockDim.x;
    auto vsrc = [&](int k) { return reinterpret_cast<const uint4*>(srcs[k] + at); };
    auto* vout = reinterpret_cast<uint4*>(out);
    auto* valso = reinterpret_cast<uint4*>(also);  // vector i at valso[i - skip]
    const size_t skip = also_first / V;
    size_t i = first + threadIdx.x;
    for (; i + (kUnroll - 1) * step < last; i += kUnroll * step) {
      uint4 r[kUnroll];
      reduce_vectors<T, Op, kUnroll>(vsrc, n, i, step, n, r);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) vout[i + u * step] = r[u];
      if (valso != nullptr) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) valso[i + u * step - skip] = r[u];
      }
    }
    for (; i < last; i += step) {
      const uint4 r = reduce_vector<T, Op>(vsrc, n, i, n);
      vout[i] = r;
      if (valso != nullptr) valso[i - skip] = r;
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
    // Vector i of out from vector i - first / V of `from` (first <= s.lo).
    const size_t lo = s.lo / V, hi = s.hi / V;
    copy_vectors(reinterpret_cast<uint4*>(out) + lo,
                 reinterpret_cast<const uint4*>(f) + (lo - first / V), hi - lo);
    done = hi * V > s.lo ? hi * V : s.lo;
  }
  for (size_t i = done + threadIdx.x; i < s.hi; i += blockDim.x) out[i] = f[i - first];
}

// Elements [s.lo, s.hi) of out zeroed: the part of a rank outside the op.
template <typename T>
__device__ void zero_span(Span s, T* out, bool vec) {
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  size_t done = s.lo;
  if (vec) {
    const size_t lo = s.lo / V, hi = s.hi / V;
    for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
      reinterpret_cast<uint4*>(out)[i] = make_uint4(0, 0, 0, 0);
    done = hi * V > s.lo ? hi * V : s.lo;
  }
  for (size_t i = done + threadIdx.x; i < s.hi; i += blockDim.x) out[i] = T{};
}

// This block's part of one output part: from `from` (that part's first
// element) where its rank took part, else zeros.
template <typename T>
__device__ void move_part(const uint8_t* from, T* out, size_t n, size_t unit, bool vec) {
  const Span p = block_part(0, n, unit);
  if (from != nullptr)
    copy_span<T>(from, 0, p, out, vec);
  else
    zero_span<T>(p, out, vec);
}

// A peer masked during this launch: the caller's active_ranks say so too.
__device__ __forceinline__ void report_masked(DirectState* st, int j) {
  if (st->report != nullptr) *reinterpret_cast<volatile int32_t*>(st->report + j) = 0;
}

// Publishes this rank's signal of op `seq` unless a peer fenced it (as
// `fenced` counts fences: a generation's input word, or a mapped op's
// per-op words, direct.h): 0 when published, else the fence. By
// compare-and-swap, so that it never lands over a fence (the header), nor
// over a newer generation's word.
template <typename Fenced>
__device__ uint64_t publish_signal(uint64_t* signal, uint32_t gen, uint64_t seq, Fenced fenced) {
  uint64_t prev = ld_acquire_sys(signal);
  for (;;) {
    if (tag_gen(prev) > gen) return 0;  // a straggler of an older setup: not its word now
    if (fenced(prev)) return prev;      // nonzero: a fence has its bit set
    const uint64_t seen = cas_sys(signal, prev, direct_tag(gen, seq));
    if (seen == prev) return 0;
    prev = seen;
  }
}

// The last look at a peer's signal of op `seq`: the signal when it came
// (`ready`: settled, or fenced as its word counts fences), else a fence
// swapped in for it, so that every rank that looks gets the same answer,
// however late a dying peer's kernel runs.
template <typename Ready>
__device__ uint64_t seal_signal(uint64_t* signal, uint32_t gen, uint64_t seq, Ready ready) {
  uint64_t v = ld_acquire_sys(signal);
  for (;;) {
    if (ready(v)) break;
    const uint64_t seen = cas_sys(signal, v, direct_fence(gen, seq));
    if (seen == v) return direct_fence(gen, seq);
    v = seen;
  }
  __threadfence_system();  // the input behind a signal found by the swap
  return v;
}

// publish_signal of a mapped op's per-op word (direct.h: tag_fenced_from):
// refused only by a fence of this op or a later one.
__device__ bool publish_op_signal(uint64_t* signal, uint32_t gen, uint64_t seq) {
  const auto fenced = [gen, seq](uint64_t v) { return tag_fenced_from(v, gen, seq); };
  return publish_signal(signal, gen, seq, fenced) == 0;
}

// Why a peer is out of an op, beside kOut (masked, fenced or retired), for
// the outcome of a watched launch.
constexpr int32_t kIn = 1;
constexpr int32_t kOut = 0;
constexpr int32_t kOutRejected = -1;
constexpr int32_t kOutMismatched = -2;
constexpr int32_t kOutStale = -3;
// Its signal came (this rank's own: not fenced), but this rank rejected its call.
constexpr int32_t kOutThisRejected = -4;

// Step 2, for rank j (a thread each): kIn where it takes part in op `seq`,
// else why not (`fenced`: this rank's own signal was, by a peer).
__device__ int32_t decide(const DirectArgs& a, DirectState* st, int j, uint64_t seq, uint32_t gen,
                          uint64_t deadline, bool fenced) {
  if (j == st->rank) {
    if (fenced) return kOut;
    return a.shape == kShapeRejected ? kOutThisRejected : kIn;  // here, with its data or not
  }
  uint8_t* area = st->areas[j];
  if (area == nullptr) return kOut;
  auto* signal = reinterpret_cast<uint64_t*>(area + DirectLayout::kInputSignal);
  const auto settled = [gen, seq](uint64_t v) { return tag_settled(v, gen, seq); };
  const auto ready = [gen, seq](uint64_t v) {
    return tag_settled(v, gen, seq) || tag_fenced(v, gen, seq);
  };
  uint64_t v = 0;
  const bool live = ld_volatile(st->live + j) != 0;
  const bool came = live && wait_for(a.c, signal, ready, deadline, j, kPhaseInput, &v);
  if (!came) {
    // Retired by the host, or masked now (lost, or past the deadline; the
    // caller's active_ranks say so): in only when its signal came before the
    // fence this look leaves (the header).
    if (live) report_masked(st, j);
    v = seal_signal(signal, gen, seq, ready);
  }
  if (!settled(v)) {  // fenced, here or by another rank: out at every rank
    if (came) report_masked(st, j);
    return kOut;
  }
  if (a.shape == kShapeRejected) return kOutThisRejected;  // this rank only takes part
  if (tag_gen(v) != gen || tag_ahead(v, seq) > 1) {
    // A newer generation: the others set up again without this rank. The
    // same one, two ops ahead: they masked this rank (silent past their
    // deadline) and went on. take_reports tells the two apart.
    report(a.c.status, kStatusDirectStale, j, static_cast<int>(tag_gen(v)));
    return kOutStale;
  }
  const uint64_t shape =
      *reinterpret_cast<const volatile uint64_t*>(area + DirectLayout::shape(seq));
  if (shape == a.shape) return kIn;
  const bool rejected = shape == kShapeRejected;
  report(a.c.status, rejected ? kStatusDirectRejected : kStatusDirectMismatch, j, 0);
  return rejected ? kOutRejected : kOutMismatched;
}

// Block 0's thread 0, once every rank is decided (`why`: decide's answers):
// the outcome of a watched launch, the ticket last.
__device__ void write_outcome(const DirectArgs& a, const int32_t* why, int ranks, int mapped = 0,
                              uint64_t sizes = 0) {
  DirectOutcome o{};
  for (int j = 0; j < ranks; ++j) {
    const uint64_t bit = uint64_t{1} << j;
    if (why[j] == kIn) o.took |= bit;
    if (why[j] == kOutRejected) o.rejected |= bit;
    if (why[j] == kOutMismatched) o.mismatched |= bit;
    if (why[j] == kOutStale) o.stale |= bit;
    if (why[j] != kOut) o.present |= bit;
  }
  volatile DirectOutcome* out = a.outcome;
  out->took = o.took;
  out->rejected = o.rejected;
  out->mismatched = o.mismatched;
  out->stale = o.stale;
  out->present = o.present;
  out->mapped = static_cast<uint64_t>(mapped);
  out->sizes = sizes;
  __threadfence_system();
  out->ticket = a.ticket;
}

// A mapped all_reduce (direct.h), block 0's thread for member j once it is
// decided (`in`): j's tensor as this process maps it, or null where it is not
// mapped here (a miss left for the host where j offered an export this
// process has not opened). This rank's own is `out`.
__device__ const uint8_t* mapped_tensor(const DirectArgs& a, const DirectState* st, int j,
                                        uint64_t seq) {
  const size_t bytes = a.count * a.esize;
  if (j == st->rank) return a.offer_gen != 0 ? static_cast<const uint8_t*>(a.out) : nullptr;
  const auto* offer =
      reinterpret_cast<const volatile uint64_t*>(st->areas[j] + DirectLayout::offer(seq));
  const uint64_t which = offer[0];
  const auto off = static_cast<int64_t>(offer[1]);
  const auto gen = static_cast<uint32_t>(which), slot = static_cast<uint32_t>(which >> 32);
  if (gen == 0 || slot >= static_cast<uint32_t>(kXSlots)) return nullptr;
  const XImport im = a.imports[j * kXSlots + static_cast<int>(slot)];
  if (im.gen != gen) {
    if (a.misses != nullptr)
      *reinterpret_cast<volatile uint64_t*>(a.misses + 2 * j) = x_miss(slot, gen);
    return nullptr;
  }
  // (16-byte aligned, as this rank's own: every share starts at a whole vector)
  if (im.base == nullptr || off < 0 || (off & 15) != 0 ||
      static_cast<uint64_t>(off) + bytes > im.size)
    return nullptr;
  return im.base + off;
}

// Thread 0 of every block, after block 0's decision (every block arrived at
// `bar` first; block 0 has waited for it): the grid waits for block 0 to
// arrive again, which it does once its waits are over (up to the whole budget).
__device__ void after_block0(const DirectArgs& a, DirectState* st, uint32_t bar, bool multi) {
  if (!multi || threadIdx.x != 0) return;
  if (blockIdx.x != 0) grid_wait(st->grid_sync, bar, a.c.timeout_ns, a.c.status);
  const uint32_t bar2 = grid_arrive(st->grid_sync);
  grid_wait(st->grid_sync, bar2, 2 * a.c.timeout_ns + 1000000000, a.c.status);
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

// Member j's per-op signal at `at` of op `seq` (block 0's thread for j):
// the signal when it came, else sealed with a fence of this op, so that
// every survivor finds the same. True where it came (settled in this
// generation, this op or the next: a member ahead by one took this op).
__device__ bool signal_came(const DirectArgs& a, DirectState* st, int j, size_t at, uint64_t seq,
                            uint32_t gen, uint64_t deadline, int phase) {
  auto* signal = reinterpret_cast<uint64_t*>(st->areas[j] + at);
  const auto settled = [gen, seq](uint64_t v) { return tag_settled(v, gen, seq); };
  const auto ready = [gen, seq](uint64_t v) {
    return tag_settled(v, gen, seq) || tag_fenced_from(v, gen, seq);
  };
  uint64_t v = 0;
  const bool live = ld_volatile(st->live + j) != 0;
  if (!live || !wait_for(a.c, signal, ready, deadline, j, phase, &v)) {
    if (live) report_masked(st, j);
    v = seal_signal(signal, gen, seq, ready);
  }
  return settled(v) && tag_gen(v) == gen && tag_ahead(v, seq) <= 1;
}

// Member j's answer in a mapped all_reduce (block 0's thread for j): 1 its
// mapped signal landed saying it reduced its share, 0 saying it could not,
// -1 it did not land (sealed: lost at every survivor).
__device__ int mapped_answer(const DirectArgs& a, DirectState* st, int j, uint64_t seq,
                             uint32_t gen, uint64_t deadline) {
  if (!signal_came(a, st, j, DirectLayout::kMappedSignal, seq, gen, deadline, kPhaseMapped))
    return -1;
  return *reinterpret_cast<const volatile uint64_t*>(st->areas[j] + DirectLayout::mapped_ok(seq)) ==
                 1
             ? 1
             : 0;
}

// Block 0's thread 0: publishes this rank's per-op signal at `at` of op
// `seq`; false where a peer fenced it (reported).
__device__ bool publish_own(const DirectArgs& a, DirectState* st, size_t at, uint64_t seq,
                            uint32_t gen) {
  __threadfence_system();
  if (publish_op_signal(reinterpret_cast<uint64_t*>(st->areas[st->rank] + at), gen, seq))
    return true;
  report(a.c.status, kStatusDirectMappedOut, st->rank, static_cast<int>(seq));
  return false;
}

// The mapped op's members (`in`) as the outcome's reasons, kIn or kOut
// (`out`: a rank counted out, this one where it wrote nothing).
__device__ void write_members(const DirectArgs& a, const int32_t* in, int R, int via,
                              int out = -1) {
  if (a.outcome == nullptr) return;
  int32_t why[kDirectMaxRanks];
  for (int j = 0; j < R; ++j) why[j] = in[j] != 0 && j != out ? kIn : kOut;
  write_outcome(a, why, R, via);
}

// A mapped all_reduce served through the segments (direct.h), every block:
// the members whose mapped signal landed (`in`: st->sources, which block 0
// rewrote) copy their tensor into their segment, meet on the copied signal,
// sum the copied members' segments into their tensor, and meet on the done
// signal. Nothing has written a tensor before: every input is whole.
template <typename T, RedOp Op>
__device__ void mapped_through_segments(const DirectArgs& a, DirectState* st, uint64_t seq,
                                        uint32_t gen, bool multi) {
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  const int R = st->ranks, me = st->rank;
  const size_t count = a.count * a.esize / sizeof(T);
  T* tensor = static_cast<T*>(a.out);
  const bool vec = a.vec;
  // 1. This rank's tensor into its segment.
  copy_span<T>(static_cast<const uint8_t*>(a.out), 0, block_part(0, count, vec ? V : 1),
               reinterpret_cast<T*>(st->areas[me] - a.plane_bytes), vec);
  __syncthreads();
  uint32_t bar = 0;
  if (multi && threadIdx.x == 0) bar = grid_arrive(st->grid_sync);
  __shared__ int s_go;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      if (multi) grid_wait(st->grid_sync, bar, a.c.timeout_ns, a.c.status);
      s_go = publish_own(a, st, DirectLayout::kMappedCopied, seq, gen) ? 1 : 0;
    }
    __syncthreads();
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    for (int j = threadIdx.x; j < R; j += blockDim.x)
      if (j != me && st->sources[j] != 0 &&
          !signal_came(a, st, j, DirectLayout::kMappedCopied, seq, gen, deadline, kPhaseMapped))
        st->sources[j] = 0;
    __syncthreads();
    if (threadIdx.x == 0) st->mapped_all = s_go;
  }
  after_block0(a, st, bar, multi);
  __shared__ int s_n;
  __shared__ const uint8_t* s_src[kDirectMaxRanks];
  __shared__ int32_t s_in[kDirectMaxRanks];
  if (threadIdx.x == 0) {
    s_go = ld_volatile(&st->mapped_all);
    int n = 0;
    for (int j = 0; j < R; ++j) {
      s_in[j] = ld_volatile(st->sources + j);
      if (s_in[j] != 0) s_src[n++] = st->areas[j] - a.plane_bytes;
    }
    s_n = n;
  }
  __syncthreads();
  // 2. Every copied member's segment summed, in rank order, into the tensor
  // (fenced here: this rank is out, and writes nothing).
  if (s_go != 0)
    reduce_span<T, Op>(s_src, s_n, 0, block_part(0, count, vec ? V : 1), tensor, nullptr, 0, vec);
  __syncthreads();
  // 3. Done reading: said, and every member's said, before the launch ends.
  bar = 0;
  if (multi && threadIdx.x == 0) bar = grid_arrive(st->grid_sync);
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      if (multi) grid_wait(st->grid_sync, bar, a.c.timeout_ns, a.c.status);
      // Fenced: a peer stopped waiting for these reads, and may write its
      // segment again under them.
      __threadfence_system();
      if (s_go != 0 &&
          !publish_op_signal(reinterpret_cast<uint64_t*>(st->areas[me] + DirectLayout::kMappedDone),
                             gen, seq))
        report(a.c.status, kStatusDirectMappedLate, me, static_cast<int>(seq));
    }
    __syncthreads();
    // A rank that read nothing (fenced) holds nothing of the others up.
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    for (int j = threadIdx.x; j < R; j += blockDim.x)
      if (s_go != 0 && j != me && s_in[j] != 0)
        signal_came(a, st, j, DirectLayout::kMappedDone, seq, gen, deadline, kPhaseMapped);
    __syncthreads();
    if (threadIdx.x == 0) write_members(a, s_in, R, s_go != 0 ? 2 : 0, s_go != 0 ? -1 : me);
  }
  after_block0(a, st, bar, multi);
}

// A mapped all_reduce (direct.h), every block, once the members are decided
// (`in`, and `src`: the n members' tensors in rank order, as mapped here).
template <typename T, RedOp Op>
__device__ void mapped_all_reduce(const DirectArgs& a, DirectState* st, uint64_t seq, uint32_t gen,
                                  const int32_t* in, const uint8_t* const* src, int n, bool multi) {
  constexpr size_t V = sizeof(uint4) / sizeof(T);
  const int R = st->ranks, me = st->rank;
  const DirectLayout& L = a.layout;
  uint8_t* own = st->areas[me];
  const size_t count = a.count * a.esize / sizeof(T);
  const size_t per = n > 0 ? direct_share_elems(count, n, sizeof(T)) : 0;
  // This rank's place among the members (-1: it is not one: fenced).
  int k = -1;
  for (int j = 0, i = 0; j < R; ++j)
    if (in[j] != 0) {
      if (j == me) k = i;
      ++i;
    }
  __shared__ int s_here;
  if (threadIdx.x == 0) s_here = ld_volatile(&st->mapped_here);
  __syncthreads();
  const bool reduce = k >= 0 && s_here != 0;
  // Its share, from every member's tensor into its area (no tensor written):
  // elements from the share's first on (a whole vector in).
  if (reduce) {
    const Span mine = share_of(k, count, per);
    T* area = reinterpret_cast<T*>(own + L.input(seq));
    reduce_span<T, Op>(src, n, mine.lo * sizeof(T), block_part(0, mine.hi - mine.lo, V), area,
                       nullptr, 0, true);
  }
  __syncthreads();
  uint32_t bar = 0;
  if (multi && threadIdx.x == 0) bar = grid_arrive(st->grid_sync);
  if (blockIdx.x == 0) {
    // s_via: 1 every share in place; 2 through the segments; 0 neither (this
    // rank is out, or there is no segment to serve it).
    __shared__ int s_via;
    if (threadIdx.x == 0) {
      if (multi) grid_wait(st->grid_sync, bar, a.c.timeout_ns, a.c.status);
      // A member: its own answer counts. A rank left out of the op writes
      // nothing and waits for none (the members do not wait for it, and may be
      // ops ahead: its host raises, and sets up again with them).
      s_via = k >= 0 ? (s_here != 0 ? 1 : 2) : 0;
      if (k >= 0) {
        *reinterpret_cast<volatile uint64_t*>(own + DirectLayout::mapped_ok(seq)) = reduce ? 1 : 0;
        // A peer stopped waiting for this rank: it writes nothing.
        if (!publish_own(a, st, DirectLayout::kMappedSignal, seq, gen)) s_via = 0;
      }
    }
    __syncthreads();
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
      if (in[j] == 0 || j == me || k < 0) continue;
      const int got = mapped_answer(a, st, j, seq, gen, deadline);
      if (got != 1) atomicCAS(&s_via, 1, 2);
      if (got < 0) st->sources[j] = 0;  // lost: out of the way through the segments
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const size_t bytes = a.count * a.esize;
      if (s_via == 2 && (a.plane_bytes < bytes || st->areas[me] == nullptr)) s_via = 0;
      st->mapped_all = s_via;
      if (s_via == 1) write_members(a, in, R, 1);
      if (s_via == 0) write_members(a, in, R, 0, me);
    }
  }
  after_block0(a, st, bar, multi);
  __shared__ int s_all;
  if (threadIdx.x == 0) s_all = ld_volatile(&st->mapped_all);
  __syncthreads();
  if (s_all == 2) {
    mapped_through_segments<T, Op>(a, st, seq, gen, multi);
    return;
  }
  if (s_all == 0) return;
  // Every share from its owner's area into this rank's tensor (its own too;
  // a rank left out may hold an unaligned one: its offer was not needed).
  T* out = static_cast<T*>(a.out);
  const bool vec = (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  for (int j = 0, i = 0; j < R; ++j) {
    if (in[j] == 0) continue;
    const Span share = share_of(i++, count, per);
    const Span piece = block_part(share.lo, share.hi, vec ? V : 1);
    if (piece.lo < piece.hi) copy_span<T>(st->areas[j] + L.input(seq), share.lo, piece, out, vec);
  }
}

// --- all_to_all with per-pair sizes (direct.h: VaryTable) ----------------------------------

// A barrier of the whole grid, every thread (block 0 may have waited up to the
// budget for its peers before it arrives).
__device__ void grid_sync_all(const DirectArgs& a, DirectState* st, bool multi) {
  __syncthreads();
  if (multi && threadIdx.x == 0) {
    const uint32_t bar = grid_arrive(st->grid_sync);
    grid_wait(st->grid_sync, bar, 2 * a.c.timeout_ns + 1000000000, a.c.status);
  }
  __syncthreads();
}

// Rounds of `region`-byte pieces that `bytes` take.
__device__ __forceinline__ uint64_t vary_rounds(uint64_t bytes, uint64_t region) {
  return bytes == 0 || region == 0 ? 0 : (bytes + region - 1) / region;
}

// Where this rank's regions lie in op `seq`, alike in every block: in its
// area's input, past the table, where every part it sends fits one region
// there; else in its segment's host-driven part.
struct VaryPlace {
  uint8_t* base;    // region p at base + p * region
  uint64_t region;  // bytes
  uint64_t back;    // 0: in the area; else the segment lies this far before the area
};

__device__ VaryPlace vary_place(const DirectArgs& a, const DirectState* st, uint64_t seq) {
  const int R = st->ranks, me = st->rank;
  const DirectLayout& L = a.layout;
  uint8_t* own = st->areas[me];
  const size_t table = VaryTable::bytes(R);
  const uint64_t in_area = L.input_bytes > table
                               ? (L.input_bytes - table) / static_cast<size_t>(R) /
                                     DirectLayout::kAlign * DirectLayout::kAlign
                               : 0;
  bool fits = true;
  for (int p = 0; p < R; ++p)
    if (p != me && a.send_bytes[p] > in_area) fits = false;
  if (fits) return {own + L.input(seq) + table, in_area, 0};
  const uint64_t region =
      a.plane_bytes / static_cast<size_t>(R) / DirectLayout::kAlign * DirectLayout::kAlign;
  return {own - a.plane_bytes, region, a.plane_bytes};
}

// `n` bytes from `src` to `dst` by the grid, a vector at a time where both
// are 16-byte aligned (a part of all_to_all_single may start anywhere).
__device__ __forceinline__ void vary_copy(uint8_t* dst, const uint8_t* src, uint64_t n) {
  copy_in(dst, src, n,
          ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0);
}

// Step 1 of a vary launch: round 0 of every part into its region (every
// block), and the table (block 0), before the input signal.
__device__ void vary_put_first(const DirectArgs& a, const DirectState* st, uint64_t seq,
                               uint32_t gen) {
  const int R = st->ranks, me = st->rank;
  const VaryPlace mine = vary_place(a, st, seq);
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    const uint64_t n = a.send_bytes[p] < mine.region ? a.send_bytes[p] : mine.region;
    if (n != 0)
      vary_copy(mine.base + static_cast<size_t>(p) * mine.region,
                static_cast<const uint8_t*>(a.in_parts[p]), n);
  }
  if (blockIdx.x == 0) {
    auto* t = reinterpret_cast<volatile uint64_t*>(st->areas[me] + a.layout.input(seq));
    for (int p = threadIdx.x; p < R; p += blockDim.x) {
      t[VaryTable::send(p)] = a.send_bytes[p];
      t[VaryTable::expect(R, p)] = a.recv_bytes[p];
      t[VaryTable::put(R, p)] = vary_word(gen, seq, 0);  // round 0: in place with the signal
    }
    if (threadIdx.x == 0) {
      t[0] = mine.region;
      t[1] = mine.back;
    }
  }
}

// Whether members i and j agree on the sizes of the parts between them, both
// ways, and those fit the rounds a word counts: from their tables, so every
// member that asks finds the same.
__device__ bool vary_pair_ok(const DirectState* st, const DirectLayout& L, int i, int j,
                             uint64_t seq) {
  const int R = st->ranks;
  const auto* ti = reinterpret_cast<const volatile uint64_t*>(st->areas[i] + L.input(seq));
  const auto* tj = reinterpret_cast<const volatile uint64_t*>(st->areas[j] + L.input(seq));
  const uint64_t ij = ti[VaryTable::send(j)], ji = tj[VaryTable::send(i)];
  return ij == tj[VaryTable::expect(R, i)] && ji == ti[VaryTable::expect(R, j)] &&
         (ij == 0 || ti[0] != 0) && (ji == 0 || tj[0] != 0) &&
         vary_rounds(ij, ti[0]) <= kVaryMaxRounds && vary_rounds(ji, tj[0]) <= kVaryMaxRounds;
}

// Block 0, once every rank is decided (`why`): whether every pair of members
// agrees on its sizes; else the first pair that does not, as a bit each, and
// the op moves nothing at any member (each raises ValueError, as the plane's
// round of sizes has every rank raise).
__device__ uint64_t vary_check(const DirectArgs& a, DirectState* st, const int32_t* why,
                               uint64_t seq) {
  __shared__ int s_bad;
  const int R = st->ranks;
  if (threadIdx.x == 0) s_bad = R * R;
  __syncthreads();
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    if (why[j] != kIn) continue;
    for (int i = j + 1; i < R; ++i)
      if (why[i] == kIn && !vary_pair_ok(st, a.layout, j, i, seq)) {
        atomicMin(&s_bad, j * R + i);
        break;
      }
  }
  __syncthreads();
  const int bad = s_bad;
  __syncthreads();
  if (bad == R * R) return 0;
  if (threadIdx.x == 0) report(a.c.status, kStatusDirectSizes, bad / R, bad % R);
  return (uint64_t{1} << (bad / R)) | (uint64_t{1} << (bad % R));
}

// Block 0's thread for peer j: waits for `word` (j's) to say round `round`
// of this op or later (`exact`: of this op only, a put of round `round`; else
// a read, where any later op of j's says it read everything of this one).
// False where j is lost, silent past the deadline, or (exact) went on past
// this op: the caller stops that direction of the pair.
__device__ bool vary_wait(const DirectArgs& a, DirectState* st, int j, const uint64_t* word,
                          uint32_t gen, uint64_t seq, uint64_t round, bool exact,
                          uint64_t deadline) {
  if (ld_volatile(st->live + j) == 0) return false;
  const auto ready = [gen, seq, round](uint64_t v) {
    return vary_reached(v, gen, seq, round, true);
  };
  uint64_t v = 0;
  if (!wait_for(a.c, word, ready, deadline, j, kPhaseVary, &v)) {
    report_masked(st, j);
    return false;
  }
  if (!exact) return true;
  // The sender stopped serving this rank (it was late to read): nothing more
  // comes, and the sender is not at fault.
  return static_cast<uint32_t>(v >> 16) == static_cast<uint32_t>(seq) &&
         (v & 0xffffu) != kVaryStopped;
}

// The moves of a vary launch (every block), once block 0 decided who takes
// part (st->sources). Each pair's two directions stop apart: a sender stops
// sending to a receiver that did not say it read the last round in time
// (st->vary_out_cut; it no longer moves that receiver's put word, so the
// receiver never reads a region it did not fill), a receiver stops reading
// from a sender whose put did not come (st->vary_in_cut). A part from a rank
// out of the op, or from a sender cut, is zeros; one that arrived whole stays.
__device__ void vary_moves(const DirectArgs& a, DirectState* st, uint64_t seq, uint32_t gen,
                           bool multi) {
  const int R = st->ranks, me = st->rank;
  const DirectLayout& L = a.layout;
  uint8_t* own = st->areas[me];
  // A pair of members disagreed on its sizes (every member raises and no
  // output is written), or this rank was fenced (it is out; it raises).
  if (ld_volatile(&st->vary_void) != 0 || ld_volatile(st->sources + me) == 0) return;
  const VaryPlace mine = vary_place(a, st, seq);
  auto* table = reinterpret_cast<uint64_t*>(own + L.input(seq));
  __shared__ const uint8_t* s_from[kDirectMaxRanks];  // j's region for this rank
  __shared__ const uint64_t* s_put[kDirectMaxRanks];  // j's put word for this rank
  __shared__ uint64_t s_region[kDirectMaxRanks];      // j's region's bytes
  __shared__ int32_t s_member[kDirectMaxRanks];       // in the op from the start
  __shared__ int32_t s_send[kDirectMaxRanks];         // still sending to j
  __shared__ int32_t s_recv[kDirectMaxRanks];         // still receiving from j
  __shared__ unsigned long long s_rounds;
  if (threadIdx.x == 0) s_rounds = 0;
  __syncthreads();
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    s_member[j] = j != me && ld_volatile(st->sources + j) != 0 ? 1 : 0;
    s_send[j] = s_recv[j] = s_member[j];
    s_from[j] = nullptr;
    s_put[j] = nullptr;
    s_region[j] = 0;
    if (s_member[j] == 0) continue;
    const auto* t = reinterpret_cast<const volatile uint64_t*>(st->areas[j] + L.input(seq));
    const uint64_t region = t[0], back = t[1];
    const uint8_t* base =
        back != 0 ? st->areas[j] - back : st->areas[j] + L.input(seq) + VaryTable::bytes(R);
    s_from[j] = base + static_cast<size_t>(me) * region;
    s_put[j] =
        reinterpret_cast<const uint64_t*>(st->areas[j] + L.input(seq)) + VaryTable::put(R, me);
    s_region[j] = region;
    const uint64_t in = vary_rounds(a.recv_bytes[j], region);
    const uint64_t out = vary_rounds(a.send_bytes[j], mine.region);
    atomicMax(&s_rounds, static_cast<unsigned long long>(in > out ? in : out));
  }
  __syncthreads();
  const uint64_t rounds = s_rounds;
  // After block 0 may have cut a direction: every block's view of them.
  auto refresh = [&] {
    grid_sync_all(a, st, multi);
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
      if (ld_volatile(st->vary_out_cut + j) != 0) s_send[j] = 0;
      if (ld_volatile(st->vary_in_cut + j) != 0) s_recv[j] = 0;
    }
    __syncthreads();
  };
  auto* out = reinterpret_cast<uint8_t* const*>(a.parts);
  // Receiver j's word saying which round it read.
  auto read_word = [&](int j) {
    return reinterpret_cast<const uint64_t*>(st->areas[j] + DirectLayout::kVaryRead);
  };
  // This rank's own part, whole, straight from its input.
  if (a.send_bytes[me] != 0)
    vary_copy(out[me], static_cast<const uint8_t*>(a.in_parts[me]), a.send_bytes[me]);
  for (uint64_t k = 0; k < rounds; ++k) {
    if (k > 0) {
      // Each receiver of a round k read round k - 1 of its region...
      if (blockIdx.x == 0) {
        const uint64_t deadline = deadline_of(a.c.timeout_ns);
        for (int j = threadIdx.x; j < R; j += blockDim.x)
          if (s_send[j] != 0 && vary_rounds(a.send_bytes[j], mine.region) > k &&
              !vary_wait(a, st, j, read_word(j), gen, seq, k - 1, false, deadline)) {
            st->vary_out_cut[j] = 1;
            // Said to it, so that it stops at once rather than wait out its deadline.
            st_release_sys(table + VaryTable::put(R, j), vary_word(gen, seq, kVaryStopped));
          }
      }
      refresh();
      // ...so round k goes in,
      for (int j = 0; j < R; ++j) {
        const uint64_t first = k * mine.region;
        if (s_send[j] == 0 || a.send_bytes[j] <= first) continue;
        const uint64_t left = a.send_bytes[j] - first;
        vary_copy(mine.base + static_cast<size_t>(j) * mine.region,
                  static_cast<const uint8_t*>(a.in_parts[j]) + first,
                  left < mine.region ? left : mine.region);
      }
      grid_sync_all(a, st, multi);
      // is said to be in (to each receiver still served), and each sender's is
      // waited for.
      if (blockIdx.x == 0) {
        __threadfence_system();
        for (int j = threadIdx.x; j < R; j += blockDim.x)
          if (s_send[j] != 0 && vary_rounds(a.send_bytes[j], mine.region) > k)
            st_release_sys(table + VaryTable::put(R, j), vary_word(gen, seq, k));
        const uint64_t deadline = deadline_of(a.c.timeout_ns);
        for (int j = threadIdx.x; j < R; j += blockDim.x)
          if (s_recv[j] != 0 && vary_rounds(a.recv_bytes[j], s_region[j]) > k &&
              !vary_wait(a, st, j, s_put[j], gen, seq, k, true, deadline))
            st->vary_in_cut[j] = 1;
      }
      refresh();
    }
    // Round k read from each sender's region.
    for (int j = 0; j < R; ++j) {
      const uint64_t first = k * s_region[j];
      if (s_recv[j] == 0 || a.recv_bytes[j] <= first) continue;
      const uint64_t left = a.recv_bytes[j] - first;
      vary_copy(out[j] + first, s_from[j], left < s_region[j] ? left : s_region[j]);
    }
    grid_sync_all(a, st, multi);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      __threadfence_system();
      st_release_sys(reinterpret_cast<uint64_t*>(own + DirectLayout::kVaryRead),
                     vary_word(gen, seq, k));
    }
  }
  // Regions in the segment: every receiver has read its last round before the
  // launch ends (the segment's next writer does not wait for the peers).
  if (mine.back != 0 && blockIdx.x == 0) {
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
      const uint64_t n = vary_rounds(a.send_bytes[j], mine.region);
      if (s_send[j] != 0 && n > 0)
        vary_wait(a, st, j, read_word(j), gen, seq, n - 1, false, deadline);
    }
  }
  refresh();
  // A rank out of the op, or a sender cut while its part moved: zeros there.
  for (int j = 0; j < R; ++j)
    if (j != me && (s_member[j] == 0 || s_recv[j] == 0) && a.recv_bytes[j] != 0) {
      const bool vec = (reinterpret_cast<uintptr_t>(out[j]) & 15) == 0;
      move_part<uint8_t>(nullptr, out[j], a.recv_bytes[j], vec ? 16 : 1, vec);
    }
}

// kMove: the kinds that only move data, with T = uint8_t (counts in bytes);
// else the reductions, T the dtype's element.
template <typename T, RedOp Op, bool kMove>
__global__ void __launch_bounds__(kDirectThreads) direct_op(DirectArgs a) {
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
  const bool root = me == a.root;
  // One part: its bytes, and its elements as this instantiation counts them.
  const size_t part_bytes = a.count * a.esize;
  const size_t part = part_bytes / sizeof(T);
  // From one part of `in` or `out` to the next (the area's parts are back to back).
  const size_t stride_bytes = a.stride * a.esize;
  const size_t stride = stride_bytes / sizeof(T);

  // 1. The input into this rank's area (a mapped op's stays where it lies).
  if (a.mapped) {
  } else if (data && a.vary) {
    vary_put_first(a, st, seq, gen);
  } else if (data && a.list == DirectList::kIn) {
    const size_t parts = direct_in_parts(a.kind, R, root);
    for (size_t p = 0; p < parts; ++p)
      copy_in(own + L.input(seq) + p * part_bytes, static_cast<const uint8_t*>(a.parts[p]),
              part_bytes, a.vec);
  } else if (data && a.in != nullptr) {
    const size_t parts = direct_in_parts(a.kind, R, root);
    const auto* in = static_cast<const uint8_t*>(a.in);
    if (stride_bytes == part_bytes)
      copy_in(own + L.input(seq), in, parts * part_bytes, a.vec);
    else
      for (size_t p = 0; p < parts; ++p)
        copy_in(own + L.input(seq) + p * part_bytes, in + p * stride_bytes, part_bytes, a.vec);
  }
  __syncthreads();
  uint32_t bar = 0;
  if (multi && threadIdx.x == 0) bar = grid_arrive(st->grid_sync);

  // 2. Block 0 publishes, then decides who takes part.
  if (blockIdx.x == 0) {
    __shared__ bool s_fenced;
    if (threadIdx.x == 0) {
      if (multi) grid_wait(st->grid_sync, bar, a.c.timeout_ns, a.c.status);
      *reinterpret_cast<volatile uint64_t*>(&st->seq) = seq;  // every block has read it
      if (a.mapped) {
        auto* offer = reinterpret_cast<volatile uint64_t*>(own + DirectLayout::offer(seq));
        offer[0] = x_miss(a.offer_slot, a.offer_gen);
        offer[1] = static_cast<uint64_t>(a.offer_off);
      }
      *reinterpret_cast<volatile uint64_t*>(own + DirectLayout::shape(seq)) = a.shape;
      __threadfence_system();
      const auto fenced = [gen](uint64_t v) { return tag_fence_of(v, gen); };
      const uint64_t fence = publish_signal(
          reinterpret_cast<uint64_t*>(own + DirectLayout::kInputSignal), gen, seq, fenced);
      s_fenced = fence != 0;
      // Once, at the op the fence began (its own active_ranks entry stays: the
      // view, not a launch, says whether this process is in the group).
      if (s_fenced && static_cast<uint32_t>(fence) == static_cast<uint32_t>(seq))
        report(a.c.status, kStatusDirectFenced, me, static_cast<int>(fence));
    }
    __syncthreads();
    __shared__ int32_t s_why[kDirectMaxRanks];
    const uint64_t deadline = deadline_of(a.c.timeout_ns);
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
      s_why[j] = decide(a, st, j, seq, gen, deadline, s_fenced);
      st->sources[j] = s_why[j] == kIn ? 1 : 0;
      if (a.vary) st->vary_in_cut[j] = st->vary_out_cut[j] = 0;
      if (a.mapped) st->mapped[j] = s_why[j] == kIn ? mapped_tensor(a, st, j, seq) : nullptr;
    }
    __syncthreads();
    if (a.mapped) {
      if (threadIdx.x == 0) {
        // Every member's tensor mapped here, and a share that fits the area.
        int n = 0, here = 1;
        for (int j = 0; j < R; ++j)
          if (s_why[j] == kIn) {
            ++n;
            here &= st->mapped[j] != nullptr ? 1 : 0;
          }
        const size_t per = n > 0 ? direct_share_elems(a.count, n, a.esize) : 0;
        if (n == 0 || per * a.esize > L.parity_bytes) here = 0;
        st->mapped_here = here;
      }
    } else {
      uint64_t sizes = 0;
      if (a.vary) {
        __syncthreads();
        sizes = vary_check(a, st, s_why, seq);
        if (threadIdx.x == 0) st->vary_void = sizes != 0 ? 1 : 0;
      }
      if (threadIdx.x == 0 && a.outcome != nullptr) write_outcome(a, s_why, R, 0, sizes);
    }
  }
  after_block0(a, st, bar, multi);
  if (threadIdx.x == 0) {
    int n = 0;
    for (int j = 0; j < R; ++j) {
      s_in[j] = ld_volatile(st->sources + j);
      if (s_in[j] != 0)
        s_src[n++] = a.mapped ? *reinterpret_cast<const uint8_t* const volatile*>(st->mapped + j)
                              : st->areas[j];
    }
    s_n = n;
  }
  __syncthreads();
  const int n = s_n;
  if constexpr (!kMove) {
    if (a.mapped) {
      mapped_all_reduce<T, Op>(a, st, seq, gen, s_in, s_src, n, multi);
      return;
    }
  }
  if (!data || n == 0) return;  // a rejected call only takes part
  T* out = static_cast<T*>(a.out);
  // Output part j of a multi-part output: in the caller's list, or `stride` apart.
  auto out_part = [&](int j) -> T* {
    return a.list == DirectList::kOut ? static_cast<T*>(a.parts[j])
                                      : out + static_cast<size_t>(j) * stride;
  };
  const uint8_t* const* areas = st->areas;
  // Where rank j's input starts in its area, when j takes part (else null).
  auto input_of = [&](int j) -> const uint8_t* {
    return s_in[j] != 0 ? areas[j] + L.input(seq) : nullptr;
  };

  // 3. The moves: each output part from the area it comes from.
  if constexpr (kMove) {
    switch (a.kind) {
      case DirectKind::kBroadcast:
        if (root && a.in == a.out) return;  // in place: nothing moves here
        move_part<T>(input_of(a.root), out, part, unit, a.vec);
        return;
      case DirectKind::kScatter: {
        const uint8_t* from = input_of(a.root);
        move_part<T>(from != nullptr ? from + static_cast<size_t>(me) * part_bytes : nullptr, out,
                     part, unit, a.vec);
        return;
      }
      case DirectKind::kGather:
        if (!root) return;
        [[fallthrough]];
      case DirectKind::kAllGather:
        for (int j = 0; j < R; ++j) move_part<T>(input_of(j), out_part(j), part, unit, a.vec);
        return;
      case DirectKind::kAllToAll:
        if (a.vary) {
          vary_moves(a, st, seq, gen, multi);
          return;
        }
        for (int j = 0; j < R; ++j) {
          const uint8_t* from = input_of(j);
          move_part<T>(from != nullptr ? from + static_cast<size_t>(me) * part_bytes : nullptr,
                       out_part(j), part, unit, a.vec);
        }
        return;
      default: return;
    }
  } else {
    // 3. The reductions of one part: reduce's at the root, reduce_scatter's
    // from this rank's part of each input, all_reduce's one-shot.
    if (a.kind == DirectKind::kReduce && !root) return;
    if (a.kind != DirectKind::kAllReduce || !a.two_shot) {
      const size_t at =
          L.input(seq) +
          (a.kind == DirectKind::kReduceScatter ? static_cast<size_t>(me) * part_bytes : 0);
      reduce_span<T, Op>(s_src, n, at, block_part(0, part, unit), out, nullptr, 0, a.vec);
      return;
    }
    // all_reduce two-shot: this rank's share, into its area and the output...
    const size_t per = direct_share_elems(part, R, sizeof(T));
    const Span mine = share_of(me, part, per);
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
      const Span share = share_of(j, part, per);
      const Span piece = block_part(share.lo, share.hi, unit);
      if (piece.lo >= piece.hi) continue;  // the same for every thread of the block
      __syncthreads();                     // s_ok's last use is over
      if (threadIdx.x == 0) s_ok = s_in[j] != 0 && share_arrived(a, st, j, seq, gen, s_deadline);
      __syncthreads();
      if (s_ok)
        copy_span<T>(st->areas[j] + L.share(seq), share.lo, piece, out, a.vec);
      else
        reduce_span<T, Op>(s_src, n, L.input(seq), piece, out, nullptr, 0, a.vec);
    }
  }
}

// The reductions of `a`, for every op they define, when its dtype's element
// is one of Ts; else kDirectNotMine (another file's).
template <typename... Ts>
int launch_reductions(const DirectArgs& a, unsigned grid, CUstream_st* stream) {
  return with_dtype_op(a.dtype, a.op, [&]<typename T, RedOp Op>() {
    if constexpr ((std::is_same_v<T, Ts> || ...)) {
      direct_op<T, Op, false><<<grid, kDirectThreads, 0, stream>>>(a);
      return static_cast<int>(cudaGetLastError());
    } else {
      return kDirectNotMine;
    }
  });
}

}  // namespace
}  // namespace mooncake::kernels
