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

// A signal's reader clears it after its last read of a call (api.h).
__device__ __forceinline__ void clear_word(uint64_t* w) {
  *reinterpret_cast<volatile uint64_t*>(w) = 0;
}

// Whether rank r takes part now: unmasked and mapped. (One the host has seen
// gone is masked by the first wait on it: wait.cuh's host_lost.)
__device__ __forceinline__ bool live(const Common& c, int r) {
  return ld_volatile(c.active_ranks + r) != 0 && c.peers[r] != nullptr;
}

// A token's slots, lane k for slot k, going to rank d (-1: none): the lanes
// whose slots go to the same rank (a lane of none: alone), and whether lane k
// holds that rank's first slot (which the rank's row serves). A warp's call.
struct SameRank {
  unsigned lanes;
  __device__ bool first(int k) const { return (lanes & ((1u << k) - 1)) == 0; }
  __device__ int first_lane() const { return __ffs(lanes) - 1; }
};
__device__ __forceinline__ SameRank same_rank(int d, int k) {
  return SameRank{__match_any_sync(0xffffffffu, d >= 0 ? d : -1 - k)};
}

// A dispatch or combine as every function of it reads it.
struct View {
  int R, me, K, C;
  int64_t epr, T, N, db;  // local experts, max tokens, this rank's tokens, a row's bytes
  HtPlan P;
  int32_t* plan;
  uint8_t* own;  // this rank's workspace
  uint32_t tag;
  int warp, lane;
};

template <typename Args>  // DispatchArgs or CombineArgs
__device__ __forceinline__ View view_of(const Args& a) {
  const int R = static_cast<int>(a.h.ws.ranks);
  const int64_t epr = a.r.num_experts / R;
  return View{R,
              a.h.c.rank,
              a.r.topk,
              static_cast<int>(a.h.ws.channels),
              epr,
              a.r.max_tokens,
              a.r.num_tokens,
              a.slots.data_bytes,
              HtPlan(R, epr, a.h.ws.channels),
              a.r.plan,
              a.h.c.peers[a.h.c.rank],
              tag_of(a.h.c.seq),
              static_cast<int>(threadIdx.x) / 32,
              static_cast<int>(threadIdx.x) % 32};
}

// This rank's answer to peer s's offer of channel c (one copy: a dispatch's
// source, a combine's replier): 1 it reads s's x in place, 2 its rows' bytes.
template <typename Args>  // DispatchArgs or CombineArgs
__device__ __forceinline__ void answer(const Args& a, const View& v, int s, int c, uint32_t how) {
  st_release_sys(word_at(a.h.c.peers[s], a.h.ws.answer(v.me, c)), signal(v.tag, how));
}

// Whether peer s takes part in this call: another rank, counted in both ways
// by the layout pass, and live.
__device__ __forceinline__ bool takes_part(const Common& c, const View& v, int s) {
  return s != v.me && v.plan[v.P.mutual(s)] != 0 && live(c, s);
}

// Reads peer s's signal word `w`. True when it carries this call's tag: then
// a count past `seen` is taken, and the peer, showing life, gets a new
// deadline. The word goes in *value.
__device__ __forceinline__ bool heard(const Common& c, const uint64_t* w, uint32_t tag,
                                      uint32_t& seen, uint64_t& deadline, uint64_t* value) {
  const uint64_t x = ld_acquire_sys(w);
  *value = x;
  if (tag_in(x) != tag) return false;
  if (count_in(x) > seen) {
    seen = count_in(x);
    deadline = deadline_of(c.timeout_ns);
  }
  return true;
}

// Thread 0's turn of a channel's round-robin over peers: from `rr` on, the
// first still served (state != 0) that `ready(s)` says has work goes in
// `pick` (-1: none), and `any` says whether any is still served.
template <typename Ready>
__device__ __forceinline__ void pick_peer(const int8_t* state, int R, Ready ready, int& rr,
                                          int& pick, bool& any) {
  int p = -1;
  bool a = false;
  for (int i = 0; i < R; ++i) {
    const int s = (rr + i) % R;
    if (state[s] == 0) continue;
    a = true;
    if (p < 0 && ready(s)) p = s;
  }
  pick = p;
  any = a;
  if (p >= 0) rr = p + 1;
}

// Waits until `w` says peer s is done with this call (as wait_for).
__device__ __forceinline__ bool wait_done(const Common& c, const uint64_t* w, uint32_t tag, int s,
                                          int phase, uint64_t* value) {
  return wait_for(
      c, w, [tag](uint64_t y) { return tag_in(y) == tag && done_in(y); }, deadline_of(c.timeout_ns),
      s, phase, value);
}

// Whether a rank whose memory peer s reads in place (one copy) stops waiting
// for s to be done: when the host (or s's life page) says s is lost, and on
// time only a whole timeout past `deadline`, which s's progress renews. Not
// on this rank's own mask of s: s may not have masked this rank, and reads on
// until it is done, so the memory must stay as it was until then.
__device__ inline bool in_place_gives_up(const Common& c, int s, uint32_t round, uint64_t deadline,
                                         int phase) {
  const auto budget = static_cast<uint64_t>(c.timeout_ns);
  if ((round & 3) == 3 && host_lost(c, s, deadline - budget)) {
    mask_peer(c, s, phase, kMaskedLost);
    return true;
  }
  if (now_ns() > deadline + budget) {
    mask_peer(c, s, phase, kMaskedSilent);
    return true;
  }
  return false;
}

// As wait_for (a word of this call that `ready` takes), for a peer that
// reads or may read this rank's memory in place: the deadline renewed
// whenever its count rises, and in_place_gives_up's rule. `stop()`, asked
// each round the word is not ready, ends the wait early (false, as giving up
// does: the caller's stop tells which).
template <typename Ready, typename Stop>
__device__ bool wait_in_place(const Common& c, const uint64_t* w, uint32_t tag, Ready ready, int s,
                              int phase, uint64_t* value, Stop stop) {
  uint32_t seen = 0;
  uint64_t deadline = deadline_of(c.timeout_ns);
  for (uint32_t round = 0;; ++round) {
    uint64_t x = 0;
    if (heard(c, w, tag, seen, deadline, &x) && ready(x)) {
      *value = x;
      return true;
    }
    if (stop()) return false;
    if (in_place_gives_up(c, s, round, deadline, phase)) return false;
    __nanosleep(100);
  }
}
template <typename Ready>
__device__ bool wait_in_place(const Common& c, const uint64_t* w, uint32_t tag, Ready ready, int s,
                              int phase, uint64_t* value) {
  return wait_in_place(c, w, tag, ready, s, phase, value, [] { return false; });
}

// Until peer s is done with this call, as wait_done, by wait_in_place's rule.
__device__ inline bool wait_done_in_place(const Common& c, const uint64_t* w, uint32_t tag, int s,
                                          int phase, uint64_t* value) {
  return wait_in_place(c, w, tag, [](uint64_t y) { return done_in(y); }, s, phase, value);
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

// A block's profiling stamp `which` (0: start, 1: its channels done: after
// every warp's), when the host asked for them (HtCommon::stamps; the same for
// the whole block, so the barrier is taken by all or none).
__device__ __forceinline__ void stamp(const HtCommon& h, int which) {
  if (h.stamps == nullptr) return;
  if (which == 1) __syncthreads();
  if (threadIdx.x == 0) h.stamps[2 * blockIdx.x + which] = now_ns();
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

// One copy (api.h): where peer s's export (slot `slot` of generation `gen`,
// `off` bytes in, `need` bytes from there) lies in this process, or null: not
// offered, not mapped here yet (recorded for the host: miss `which`), or out
// of the mapping's bounds. Args: DispatchArgs or CombineArgs.
template <typename Args>
__device__ const uint8_t* imported(const Args& a, int s, uint32_t gen, uint32_t slot, int64_t off,
                                   int64_t need, int which) {
  if (gen == 0 || slot >= static_cast<uint32_t>(kXSlots)) return nullptr;
  const XImport im = a.imports[s * kXSlots + slot];
  if (im.gen != gen) {
    if (a.misses != nullptr)
      *reinterpret_cast<volatile uint64_t*>(a.misses + 2 * s + which) = x_miss(slot, gen);
    return nullptr;
  }
  if (im.base == nullptr || off < 0 || need < 0 || static_cast<uint64_t>(off + need) > im.size)
    return nullptr;
  return im.base + off;
}

// Peer s's offer record of channel c (one copy: its XShare), from its workspace.
__device__ __forceinline__ XShare offered_share(const Common& c, const HtLayout& ws, int s,
                                                int ch) {
  const auto* r = reinterpret_cast<const volatile XShare*>(c.peers[s] + ws.share(ch));
  return XShare{r->gen, r->slot, r->off, r->stride, r->rows, r->sgen, r->sslot, r->soff};
}

// `poll(round)` by each thread of [0, R) whose `pending` is non-zero (it
// clears its own when done), round after round until none is: a peer slow to
// signal holds no other's turn. Every thread of the block calls it; `any` is
// block-shared scratch.
template <typename Poll>
__device__ void poll_rounds(int R, const int8_t* pending, bool* any, Poll poll) {
  for (uint32_t round = 0;; ++round) {
    if (static_cast<int>(threadIdx.x) < R && pending[threadIdx.x] != 0) poll(round);
    __syncthreads();
    if (threadIdx.x == 0) {
      bool a = false;
      for (int r = 0; r < R; ++r) a = a || pending[r] != 0;
      *any = a;
    }
    __syncthreads();
    if (!*any) return;
    __nanosleep(128);
  }
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
