// High-throughput combine (api.h: CombineArgs, launch_combine), along a
// dispatch's plan.
//
// Replier blocks hand back, channel by channel, the rows this rank received
// from each source's channel (the dispatch recorded which): its expert output
// row, with do_expand the fp32 sum of the token's expanded rows rounded once
// (or, without multiple reductions, each expanded row), staged in a ring per
// (source, channel) that the source pulls from. Reducer blocks take this
// rank's tokens a batch at a time, wait until every rank holding one of
// their experts has staged the batch's rows, and sum each token's rows in
// fp32, slot by slot in top-k order (its own rows straight from x), rounding
// once: the portable path's order, so the results are bit for bit its. One
// copy (api.h; plain rows): a replier offers its x and weights, and a source
// that has them mapped reads its rows there (kPeerX), nothing staged for it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/common/convert.cuh"
#include "kernels/common/copy.cuh"
#include "kernels/common/scan.cuh"
#include "kernels/ep_ht/common.cuh"

namespace mooncake::kernels::ep_ht {
namespace {

// 16 bytes of an element type as fp32 and back (round to nearest even).
template <typename T>
struct Vec {
  static constexpr int kN = 8;
  static __device__ __forceinline__ void load(const int4& v, float (&f)[8]) { to_float8<T>(v, f); }
  static __device__ __forceinline__ int4 store(const float (&f)[8]) { return from_float8<T>(f); }
};
template <>
struct Vec<float> {
  static constexpr int kN = 4;
  static __device__ __forceinline__ void load(const int4& v, float (&f)[8]) {
    f[0] = __int_as_float(v.x);
    f[1] = __int_as_float(v.y);
    f[2] = __int_as_float(v.z);
    f[3] = __int_as_float(v.w);
  }
  static __device__ __forceinline__ int4 store(const float (&f)[8]) {
    return int4{__float_as_int(f[0]), __float_as_int(f[1]), __float_as_int(f[2]),
                __float_as_int(f[3])};
  }
};

// x may come trimmed to the layout's valid rows (upstream's callers pass it so),
// so every read of x checks the row against x's rows: a row past them (x trimmed
// short) reads as zero, and the kernel's first thread reports it (short_x).
__device__ void short_x(const CombineArgs& a, const View& v) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t valid = v.plan[HtPlan::kRows];
  if (a.expand)  // the last expert's valid rows end them (its padding is not read)
    valid = v.epr > 0 ? v.plan[v.P.start(v.epr - 1)] + v.plan[v.P.count(v.epr - 1)] : 0;
  if (a.rows < valid)
    report(a.h.c.status, kHtShortX, static_cast<int32_t>(a.rows), static_cast<int32_t>(valid));
}

// The streams of a channel, one per peer rank.
struct Peers {
  uint32_t staged[kMaxRanks];              // replier: rows staged for a source
  uint32_t head[kMaxRanks];                // replier: how far the source read them
  uint32_t cons[kMaxRanks];                // reducer: rows read from a replier
  uint32_t need[kMaxRanks];                // reducer: rows this batch needs from it
  int32_t cur[kMaxRanks], end[kMaxRanks];  // replier: the source's rows left to stage
  uint64_t deadline[kMaxRanks];
  int8_t state[kMaxRanks];  // 1 while serving / reading
  bool done_sent[kMaxRanks];
  // reducer, one copy: a replier's x and weights read in place (null: its
  // ring), the first of this rank's rows there, and its rows
  const uint8_t* xb[kMaxRanks];
  const float* wb[kMaxRanks];
  int64_t row0[kMaxRanks], xn[kMaxRanks];
  int8_t offering[kMaxRanks];  // reducer: its offer not yet taken
  uint32_t beat[kMaxRanks];    // reducer: batches read in place, acknowledged
  bool in_place[kMaxRanks];    // replier: the source reads its rows in place
  bool asked[kMaxRanks];       // replier: its answer to the offer awaited
  bool took[kMaxRanks];        // reducer: it answered that it reads in place
};

// 512-byte groups of a row a reducer's warp sums at once (reduce_channel).
constexpr int kSpan = 4;

// What a reducer adds for a token, in top-k order (kPeerX: a replier's row
// read in place, one copy).
enum Kind : int8_t { kNone = 0, kOwnRow = 1, kOwnSum = 2, kPeerRow = 3, kPeerX = 4 };

struct Shared {
  Peers p;
  // replier: a batch of items (a row, and its slot when rows go one by one)
  int32_t item_row[kBatch], item_slot[kBatch];
  int nitems, nrows;
  // reducer: per token of a batch and slot
  const uint8_t* ptr[kBatch][kMaxTopk];  // the row (kOwnSum: its metadata row)
  const float* wptr[kBatch][kMaxTopk];   // the weight slot k takes (null: 0)
  int8_t kind[kBatch][kMaxTopk];
  int8_t dest[kBatch][kMaxTopk];  // the rank it comes from
  int8_t nent[kBatch];
  int pick, rr;
  bool any;
};

// Bytes [off, off + 16) of the fp32 sum of x's rows at a metadata row's
// expanded columns (slot by slot), rounded once to T.
template <typename T>
__device__ int4 sum_expanded(const CombineArgs& a, const View& v, const int32_t* meta,
                             int64_t off) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < v.K; ++k) {
    const int32_t q = meta[2 + k];
    if (q < 0 || q >= a.rows) continue;  // (past a short x: zero, short_x)
    float f[8];
    Vec<T>::load(__ldg(reinterpret_cast<const int4*>(a.x + q * v.db + off)), f);
#pragma unroll
    for (int i = 0; i < Vec<T>::kN; ++i) acc[i] += f[i];
  }
  return Vec<T>::store(acc);
}

// --- the replier --------------------------------------------------------------------

template <typename T>
__device__ void reply_channel(const CombineArgs& a, const View& v, int c, Shared& sh) {
  const Common& cm = a.h.c;
  const int tid = threadIdx.x;
  const int64_t S = a.slots.count;
  const bool expand_sum = a.expand && !a.single;
  // A row's items (one by one: its local slots) never exceed K, even with an expert
  // selected twice (reported, not refused): so a picked row always fits, and a pick
  // always moves on (one that staged nothing would spin without a deadline).
  const int room_needed = a.single ? v.K : 1;
  Peers& p = sh.p;
  if (tid < v.R) {
    const int s = tid;
    p.state[s] = takes_part(cm, v, s);
    p.cur[s] = v.plan[v.P.src_off(s)] + v.plan[v.P.chan_first(s, c)];
    p.end[s] = p.cur[s] + v.plan[v.P.chan_count(s, c)];
    p.staged[s] = p.head[s] = 0;
    p.done_sent[s] = false;
    p.in_place[s] = p.asked[s] = false;
    p.deadline[s] = deadline_of(cm.timeout_ns);
  }
  if (tid == 0) sh.rr = 0;
  __syncthreads();
  if (a.imports != nullptr && !a.expand) {
    // One copy: x (and weights) offered to each source with the first of its
    // rows. Each answer is taken in the loop below as it comes (a source slow
    // to answer holds no other's rows back); a source that reads them in place
    // gets none staged, only the done signal, which tells it the answer was
    // taken (it reads nothing before), and its acknowledgements after each of
    // its batches keep this rank waiting for its last one while it reads.
    const bool offer = a.share.gen != 0;
    if (offer && tid == 0) *reinterpret_cast<XShare*>(v.own + a.h.ws.share(c)) = a.share;
    __syncthreads();
    if (tid < v.R && p.state[tid] != 0) {
      const int s = tid;
      const auto first = static_cast<uint32_t>(v.plan[v.P.src_off(s)]);
      st_release_sys(word_at(cm.peers[s], a.h.ws.offer(v.me, c)),
                     signal(v.tag, offer ? 3u + first : 2u));
      p.asked[s] = offer;
    }
  }
  for (uint32_t round = 0;; ++round) {
    if (tid < v.R && p.state[tid] != 0 && p.asked[tid]) {
      // Its answer, awaited: nothing staged nor done until it comes.
      const int s = tid;
      auto* w = word_at(v.own, a.h.ws.answer(s, c));
      const uint64_t x = ld_acquire_sys(w);
      if (tag_in(x) == v.tag) {
        clear_word(w);
        p.asked[s] = false;
        if (static_cast<uint32_t>(x) == 1) {
          p.cur[s] = p.end[s];  // read in place
          p.in_place[s] = true;
        }
        p.deadline[s] = deadline_of(cm.timeout_ns);
      } else if (gives_up(cm, s, round, p.deadline[s], kSend)) {
        p.state[s] = 0;  // masked (it reads nothing in place: no done signal came)
      }
    } else if (tid < v.R && p.state[tid] != 0) {
      const int s = tid;
      auto* w = word_at(v.own, a.h.ws.combine_head(s, c));
      uint64_t x = 0;
      if (heard(cm, w, v.tag, p.head[s], p.deadline[s], &x) && done_in(x) && p.done_sent[s]) {
        clear_word(w);  // acknowledged: its last word in this call
        p.state[s] = 0;
      }
      if (p.state[s] != 0 && !p.done_sent[s] && p.cur[s] == p.end[s]) {
        st_release_sys(word_at(cm.peers[s], a.h.ws.combine_tail(v.me, c)),
                       signal(v.tag, p.staged[s] | kDone));
        p.done_sent[s] = true;
        p.deadline[s] = deadline_of(cm.timeout_ns);
      }
      const bool stuck = p.done_sent[s] || S - (p.staged[s] - p.head[s]) < room_needed;
      const bool stop = p.in_place[s] ? in_place_gives_up(cm, s, round, p.deadline[s], kSend)
                                      : gives_up(cm, s, round, p.deadline[s], kSend);
      if (p.state[s] != 0 && stuck && stop) p.state[s] = 0;
    }
    __syncthreads();
    if (tid == 0) {
      const auto ready = [&](int s) {
        return !p.asked[s] && !p.done_sent[s] && p.cur[s] < p.end[s] &&
               S - (p.staged[s] - p.head[s]) >= room_needed;
      };
      pick_peer(p.state, v.R, ready, sh.rr, sh.pick, sh.any);
    }
    __syncthreads();
    const int s = sh.pick;
    if (s < 0) {
      if (!sh.any) break;
      __nanosleep(128);
      continue;
    }
    const uint32_t staged = p.staged[s];
    const int budget = static_cast<int>(imin<int64_t>(kBatch, S - (staged - p.head[s])));
    if (v.warp == 0) {
      // A lane per row; rows whose items all fit, in order.
      const int32_t row = p.cur[s] + v.lane;
      const int32_t* meta = a.metadata + static_cast<int64_t>(row) * (v.K + 2);
      int items = 0;
      if (row < p.end[s]) {
        items = 1;
        if (a.single) {
          items = 0;
          for (int k = 0; k < v.K; ++k) items += meta[2 + k] >= 0;
        }
      }
      const int incl = warp_inclusive_sum(items, v.lane);
      const bool take = row < p.end[s] && incl <= budget;
      const unsigned taken = __ballot_sync(0xffffffffu, take);
      if (take) {
        int at = incl - items;
        if (a.single) {
          for (int k = 0; k < v.K; ++k)
            if (meta[2 + k] >= 0) {
              sh.item_row[at] = row;
              sh.item_slot[at++] = k;
            }
        } else {
          sh.item_row[at] = row;
          sh.item_slot[at] = -1;
        }
      }
      const int nrows = __popc(taken);
      const int nitems = nrows > 0 ? __shfl_sync(0xffffffffu, incl, nrows - 1) : 0;
      if (v.lane == 0) {
        sh.nrows = nrows;
        sh.nitems = nitems;
      }
    }
    __syncthreads();
    const int n = sh.nitems;
    uint8_t* ring = v.own + a.h.ws.rings + (static_cast<int64_t>(s) * v.C + c) * S * a.slots.bytes;
    if (v.warp == 0 && v.lane < n && a.slots.weights) {
      const int32_t row = sh.item_row[v.lane], k1 = sh.item_slot[v.lane];
      const int32_t* meta = a.metadata + static_cast<int64_t>(row) * (v.K + 2);
      auto* w =
          reinterpret_cast<float*>(ring + ((staged + v.lane) % S) * a.slots.bytes + a.slots.wts);
      for (int k = 0; k < v.K; ++k) {
        float x = 0.0f;
        if (!a.expand) {
          if (row < a.rows) x = a.weights[static_cast<int64_t>(row) * v.K + k];
        } else if (meta[2 + k] >= 0 && meta[2 + k] < a.rows && (!a.single || k == k1)) {
          x = a.weights[meta[2 + k]];
        }
        w[k] = x;
      }
    }
    if (expand_sum) {
      const int64_t groups = (v.db + 511) / 512;
      for (int64_t u = v.warp; u < n * groups; u += kWarps) {
        const int i = static_cast<int>(u / groups);
        const int64_t off = (u % groups) * 512 + v.lane * 16;
        if (off >= v.db) continue;
        const int32_t* meta = a.metadata + static_cast<int64_t>(sh.item_row[i]) * (v.K + 2);
        uint8_t* slot = ring + ((staged + i) % S) * a.slots.bytes + a.slots.data;
        *reinterpret_cast<int4*>(slot + off) = sum_expanded<T>(a, v, meta, off);
      }
    } else {
      const int64_t per_row = chunks_of(v.db);
      for (int64_t u = v.warp; u < n * per_row; u += kWarps) {
        const int i = static_cast<int>(u / per_row);
        const int32_t row = sh.item_row[i];
        const int64_t src_row =
            a.single ? a.metadata[static_cast<int64_t>(row) * (v.K + 2) + 2 + sh.item_slot[i]]
                     : row;
        uint8_t* slot = ring + ((staged + i) % S) * a.slots.bytes + a.slots.data;
        if (src_row < a.rows) {
          copy_chunk<false>(slot, a.x + src_row * v.db, v.db, u % per_row, v.lane);
        } else {  // past a short x: zero (short_x)
          const int4 zero[kVecs] = {};
          store_chunk(slot, zero, v.db, u % per_row, v.lane);
        }
      }
    }
    __syncthreads();
    if (tid == 0) {
      p.staged[s] = staged + n;
      p.cur[s] += sh.nrows;
      st_release_sys(word_at(cm.peers[s], a.h.ws.combine_tail(v.me, c)), signal(v.tag, staged + n));
    }
    __syncthreads();
  }
}

// --- the reducer --------------------------------------------------------------------

// One copy: each replier's offer of channel c, in rounds (a thread per
// replier); this rank answers whether it reads that replier's rows in place
// (it has its x, and weights where it needs them, mapped) and notes where.
__device__ void take_offers(const CombineArgs& a, const View& v, int c, Shared& sh) {
  const Common& cm = a.h.c;
  const int d = threadIdx.x;
  Peers& p = sh.p;
  int8_t* waiting = p.offering;
  if (d < v.R) {
    p.wb[d] = nullptr;
    p.row0[d] = p.xn[d] = 0;
    waiting[d] = p.state[d];
    p.deadline[d] = deadline_of(cm.timeout_ns);
  }
  __syncthreads();
  poll_rounds(v.R, waiting, &sh.any, [&](uint32_t round) {
    auto* w = word_at(v.own, a.h.ws.offer(d, c));
    const uint64_t x = ld_acquire_sys(w);
    if (tag_in(x) == v.tag) {
      clear_word(w);
      waiting[d] = 0;
      const auto value = static_cast<uint32_t>(x);
      if (value < 3) return;  // not offered
      const XShare r = offered_share(cm, a.h.ws, d, c);
      const uint8_t* xb = nullptr;
      const uint8_t* wb = nullptr;
      if (r.stride == v.db && r.rows >= 1) {
        xb = imported(a, d, r.gen, r.slot, r.off, r.rows * v.db, 0);
        if (xb != nullptr && a.out_w != nullptr) {
          wb = imported(a, d, r.sgen, r.sslot, r.soff, r.rows * v.K * 4, 1);
          if (wb == nullptr) xb = nullptr;
        }
      }
      if (xb != nullptr) {
        p.xb[d] = xb;
        p.wb[d] = reinterpret_cast<const float*>(wb);
        p.row0[d] = value - 3;
        p.xn[d] = r.rows;
      }
      answer(a, v, d, c, xb != nullptr ? 1u : 2u);
      p.took[d] = xb != nullptr;
      if (a.counts != nullptr) atomicAdd(a.counts + (xb != nullptr ? 2 : 3), 1ull);
    } else if (gives_up(cm, d, round, p.deadline[d], kRecv)) {
      waiting[d] = 0;
      p.state[d] = 0;  // masked
    }
  });
  // A replier read in place: its done signal (sent once it took the answer)
  // first, so that nothing is read from a replier that gave up waiting for
  // the answer (and may have gone on, its x with it). Left set for the end.
  if (d < v.R && p.xb[d] != nullptr) {
    uint64_t x = 0;
    const bool done = wait_done(cm, word_at(v.own, a.h.ws.combine_tail(d, c)), v.tag, d, kRecv, &x);
    if (!done || count_in(x) != 0) {
      if (done) report(cm.status, kHtBadRow, d, static_cast<int>(count_in(x)));  // rows staged
      p.xb[d] = nullptr;
      p.state[d] = 0;  // masked (or corrupt)
    }
    p.beat[d] = 0;
  }
  __syncthreads();
}

// A batch's plan, every warp's call: what each slot of each token adds, and how
// many rows the batch needs from each rank. A warp a token with lane k for slot
// k (the slots' loads at once: one lane looping over K, a round trip each, was
// most of a batch's time alone), but for the rings' order, warp 0 a lane per
// token (from shared memory alone).
__device__ void plan_batch(const CombineArgs& a, const View& v, int c, int64_t tb, int nb,
                           Shared& sh) {
  const int64_t S = a.slots.count;
  const int k = v.lane;
  const bool slot = k < v.K;
  // Each slot's rank and kind.
  for (int j = v.warp; j < nb; j += kWarps) {
    const int64_t t = tb + j;
    const int64_t e = slot ? expert_at(a.r, t, k) : -1;
    int d = e >= 0 ? static_cast<int>(e / v.epr) : -1;
    // A rank's row serves its first slot (rows one by one: every slot).
    const SameRank same = same_rank(d, k);
    const bool entry = d >= 0 && (a.single || same.first(k));
    if (!slot) continue;
    if (d >= 0 && d != v.me && sh.p.state[d] == 0) d = -1;  // a rank not taking part
    Kind kind = kNone;
    const uint8_t* ptr = nullptr;
    if (entry && d == v.me) {
      kind = kOwnRow;
    } else if (entry && d >= 0 && sh.p.xb[d] == nullptr) {
      kind = kPeerRow;
    } else if (entry && d >= 0) {
      // One copy: its row there, read in place (past the rows offered: that
      // rank's x was short, which its own short_x reports; the row adds nothing).
      const int64_t row = sh.p.row0[d] + place_of(a.r, t, k, d);
      if (row < sh.p.xn[d]) {
        kind = kPeerX;
        ptr = sh.p.xb[d] + row * v.db;
      } else if (row >= v.R * v.T) {  // past any layout: corrupt
        report(a.h.c.status, kHtBadRow, d, static_cast<int>(row));
      }
    }
    sh.dest[j][k] = static_cast<int8_t>(d);
    sh.kind[j][k] = kind;
    sh.ptr[j][k] = ptr;
    sh.wptr[j][k] = nullptr;
  }
  __syncthreads();
  // Per rank, the batch's rows from it in order: tokens in order, slots in order.
  if (v.warp == 0) {
    const int j = v.lane;
    const bool mine = j < nb;
    for (int d = 0; d < v.R; ++d) {
      if (d == v.me || sh.p.state[d] == 0) continue;
      int cnt = 0;
      if (mine)
        for (int q = 0; q < v.K; ++q) cnt += sh.kind[j][q] == kPeerRow && sh.dest[j][q] == d;
      const int incl = warp_inclusive_sum(cnt, j);
      if (j == 31) sh.p.need[d] = incl;
      if (mine) {
        uint32_t at = sh.p.cons[d] + (incl - cnt);
        const uint8_t* ring = a.h.c.peers[d] + a.h.ws.rings +
                              (static_cast<int64_t>(v.me) * v.C + c) * S * a.slots.bytes;
        for (int q = 0; q < v.K; ++q)
          if (sh.kind[j][q] == kPeerRow && sh.dest[j][q] == d)
            sh.ptr[j][q] = ring + (at++ % S) * a.slots.bytes;
      }
    }
  }
  __syncthreads();
  // Own rows, and where each slot's weight comes from.
  for (int j = v.warp; j < nb; j += kWarps) {
    const int64_t t = tb + j;
    const int d = slot ? sh.dest[j][k] : -1;
    // this token's own row here (its rows, expanded): its first slot here
    const unsigned here = __ballot_sync(0xffffffffu, d == v.me);
    int32_t own_row = -1;
    if (here != 0) {
      const int k0 = __ffs(here) - 1;
      own_row = __shfl_sync(
          0xffffffffu, k == k0 ? v.plan[v.P.src_off(v.me)] + place_of(a.r, t, k0, v.me) : 0, k0);
    }
    // the row of slot k's rank: its first slot's (its own, one by one)
    const SameRank same = same_rank(d, k);
    const int k1 = a.single ? k : same.first_lane();
    if (d < 0) continue;
    const int32_t* own_meta =
        own_row >= 0 ? a.metadata + static_cast<int64_t>(own_row) * (v.K + 2) : nullptr;
    // slot k's row of this rank's x (slots here alone)
    const int64_t r = d != v.me ? -1 : !a.expand ? own_row : own_meta[2 + k];
    if (sh.kind[j][k] == kOwnRow) {
      if (a.expand && !a.single) {
        sh.kind[j][k] = kOwnSum;  // (sum_expanded reads rows past a short x as zero)
        sh.ptr[j][k] = reinterpret_cast<const uint8_t*>(own_meta);
      } else if (r < a.rows) {
        sh.ptr[j][k] = a.x + r * v.db;
      } else {
        sh.kind[j][k] = kNone;  // past a short x: adds nothing (short_x)
      }
    }
    // (the peers' weights come back whatever this rank's x holds: a rank of no valid
    // rows may pass weights of none, with no storage)
    if (a.out_w == nullptr) continue;
    if (d == v.me) {
      if (a.weights != nullptr && r < a.rows)
        sh.wptr[j][k] = !a.expand ? a.weights + r * v.K + k : a.weights + r;
    } else if (sh.kind[j][k1] == kPeerX) {
      sh.wptr[j][k] = sh.p.wb[d] != nullptr
                          ? sh.p.wb[d] + (sh.ptr[j][k1] - sh.p.xb[d]) / v.db * v.K + k
                          : nullptr;
    } else if (sh.ptr[j][k1] != nullptr) {
      sh.wptr[j][k] = reinterpret_cast<const float*>(sh.ptr[j][k1] + a.slots.wts) + k;
    }
  }
}

template <typename T>
__device__ void reduce_channel(const CombineArgs& a, const View& v, int c, Shared& sh) {
  const Common& cm = a.h.c;
  const int tid = threadIdx.x;
  const int64_t S = a.slots.count;
  Peers& p = sh.p;
  if (tid < v.R) {
    const int d = tid;
    p.state[d] = takes_part(cm, v, d);
    p.cons[d] = p.need[d] = 0;
    p.xb[d] = nullptr;
    p.took[d] = false;  // (set by take_offers alone: the end reads it, one copy or not)
  }
  __syncthreads();
  if (a.imports != nullptr && !a.expand) take_offers(a, v, c, sh);  // (block-uniform)
  // Tokens a batch: the rows it needs from one rank must fit in its ring.
  const int64_t per_token = a.single ? v.K : 1;  // the replier's room_needed
  const int64_t B = v.R > 1 ? imax<int64_t>(1, imin<int64_t>(kBatch, S / per_token)) : kBatch;
  const Span sp = channel_span(v.N, v.C, c);
  const int64_t spans = ((v.db + 511) / 512 + kSpan - 1) / kSpan;
  for (int64_t tb = sp.first; tb < sp.end; tb += B) {
    const int nb = static_cast<int>(imin<int64_t>(B, sp.end - tb));
    // A replier read in place and masked since counts as nothing from here on.
    if (tid < v.R && p.state[tid] != 0 && sh.p.xb[tid] != nullptr && !live(cm, tid))
      p.state[tid] = 0;
    __syncthreads();
    plan_batch(a, v, c, tb, nb, sh);
    __syncthreads();
    if (tid < v.R && p.state[tid] != 0 && p.need[tid] > 0) {
      const int d = tid;
      const uint32_t want = p.cons[d] + p.need[d];
      uint64_t x = 0;
      if (!wait_for(
              cm, word_at(v.own, a.h.ws.combine_tail(d, c)),
              [tag = v.tag, want](uint64_t y) { return tag_in(y) == tag && count_in(y) >= want; },
              deadline_of(cm.timeout_ns), d, kRecv, &x))
        p.state[d] = 0;  // masked: what it holds counts as nothing, from here on
    }
    __syncthreads();
    // The slots that count, in order (a warp a token, lane k for slot k); and the
    // weights each slot's rank sent back.
    for (int j = v.warp; j < nb; j += kWarps) {
      const int k = v.lane;
      const bool slot = k < v.K;
      const int d = slot ? sh.dest[j][k] : -1;
      const bool ok = d >= 0 && (d == v.me || p.state[d] != 0);
      const int8_t kind = slot ? sh.kind[j][k] : kNone;
      const uint8_t* ptr = slot ? sh.ptr[j][k] : nullptr;
      if (slot && a.out_w != nullptr)
        a.out_w[(tb + j) * v.K + k] = ok && sh.wptr[j][k] != nullptr
                                          ? *reinterpret_cast<const volatile float*>(sh.wptr[j][k])
                                          : 0.0f;
      const unsigned adds = __ballot_sync(0xffffffffu, ok && kind != kNone);
      __syncwarp();  // every lane has read its slot before any is overwritten
      if ((adds >> k) & 1) {
        const int at = __popc(adds & ((1u << k) - 1));
        sh.kind[j][at] = kind;
        sh.ptr[j][at] = ptr;
      }
      if (k == 0) sh.nent[j] = static_cast<int8_t>(__popc(adds));
    }
    __syncthreads();
    // A warp sums kSpan 512-byte groups of a token's row at once, row by row:
    // kSpan loads a lane in flight even where a token has one row (alone, or
    // its experts on one rank), where one group at a time left one.
    for (int64_t u = v.warp; u < nb * spans; u += kWarps) {
      const int j = static_cast<int>(u / spans);
      const int64_t first = (u % spans) * (kSpan * 512) + v.lane * 16;
      float acc[kSpan][8] = {};
      const int n = sh.nent[j];
      for (int e = 0; e < n; ++e) {
        const int8_t kind = sh.kind[j][e];
        const uint8_t* ptr = sh.ptr[j][e];
        int4 raw[kSpan];
#pragma unroll
        for (int g = 0; g < kSpan; ++g) {
          const int64_t off = first + g * 512;
          if (off >= v.db) break;
          if (kind == kPeerRow)  // plain loads: written by a peer during this launch
            raw[g] = *reinterpret_cast<const int4*>(ptr + a.slots.data + off);
          else if (kind == kPeerX)  // plain loads: a peer's x, after its offer's acquire
            raw[g] = *reinterpret_cast<const int4*>(ptr + off);
          else if (kind == kOwnRow)
            raw[g] = __ldg(reinterpret_cast<const int4*>(ptr + off));
          else  // kOwnSum: rounded once here, as the replier rounds its sums
            raw[g] = sum_expanded<T>(a, v, reinterpret_cast<const int32_t*>(ptr), off);
        }
        // added in slot order, as the portable path adds
#pragma unroll
        for (int g = 0; g < kSpan; ++g) {
          if (first + g * 512 >= v.db) break;
          float f[8];
          Vec<T>::load(raw[g], f);
#pragma unroll
          for (int i = 0; i < Vec<T>::kN; ++i) acc[g][i] += f[i];
        }
      }
#pragma unroll
      for (int g = 0; g < kSpan; ++g) {
        const int64_t off = first + g * 512;
        if (off >= v.db) break;
        *reinterpret_cast<int4*>(a.out + (tb + j) * v.db + off) = Vec<T>::store(acc[g]);
      }
    }
    __syncthreads();
    if (tid < v.R && p.state[tid] != 0 && p.need[tid] > 0) {
      // The rows are read (the barrier above): the replier may reuse them.
      const int d = tid;
      p.cons[d] += p.need[d];
      st_release_sys(word_at(cm.peers[d], a.h.ws.combine_head(v.me, c)), signal(v.tag, p.cons[d]));
    } else if (tid < v.R && p.state[tid] != 0 && p.xb[tid] != nullptr) {
      // Read in place: progress, so that the replier's wait for the end goes on.
      const int d = tid;
      st_release_sys(word_at(cm.peers[d], a.h.ws.combine_head(v.me, c)),
                     signal(v.tag, ++p.beat[d]));
    }
    __syncthreads();
  }
  // The end: each replier's total, cleared and acknowledged.
  if (tid < v.R && p.state[tid] != 0) {
    const int d = tid;
    auto* w = word_at(v.own, a.h.ws.combine_tail(d, c));
    uint64_t x = 0;
    if (wait_done(cm, w, v.tag, d, kRecv, &x)) {
      if (count_in(x) != p.cons[d]) report(cm.status, kHtBadRow, d, static_cast<int>(count_in(x)));
      clear_word(w);
      st_release_sys(word_at(cm.peers[d], a.h.ws.combine_head(v.me, c)),
                     signal(v.tag, p.cons[d] | kDone));
    }
  } else if (tid < v.R && p.took[tid]) {
    // Answered "in place", then masked here (before or during the reads): its
    // done signal cleared, and its wait for this rank's reads ended now, not
    // at its time limit (a done signal coming after this stays: the next call
    // has another tag, a replay of the same graph would take it).
    const int d = tid;
    clear_word(word_at(v.own, a.h.ws.combine_tail(d, c)));
    st_release_sys(word_at(cm.peers[d], a.h.ws.combine_head(v.me, c)), signal(v.tag, kDone));
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const CombineArgs a) {
  __shared__ Shared sh;
  const View v = view_of(a);
  const Roles roles = roles_of(v.R);
  stamp(a.h, 0);
  short_x(a, v);
  if (roles.sends()) {
    for (int c = roles.index(); c < v.C; c += roles.count()) reply_channel<T>(a, v, c, sh);
  } else {
    for (int c = roles.index(); c < v.C; c += roles.count()) reduce_channel<T>(a, v, c, sh);
  }
  stamp(a.h, 1);
}

}  // namespace

void launch_combine(const CombineArgs& a, int blocks, CUstream_st* stream) {
  const int64_t R = a.h.ws.ranks;
  MC_CHECK_ARG(R >= 1 && R <= kMaxRanks, "combine: ", R, " ranks; the device path takes at most ",
               kMaxRanks);
  MC_CHECK_ARG(a.slots.data_bytes % 16 == 0, "combine: rows of ", a.slots.data_bytes,
               " bytes must be a multiple of 16");
  MC_CHECK_ARG(R == 1 || (blocks >= 2 && a.slots.count >= kMinSlots), "combine: ", blocks,
               " blocks and ", a.slots.count, " ring slots; with peers at least 2 and ", kMinSlots);
  const auto grid = static_cast<unsigned>(blocks);
  switch (a.elem) {
    case Elem::kBf16: combine_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a); break;
    case Elem::kFp16: combine_kernel<__half><<<grid, kThreads, 0, stream>>>(a); break;
    case Elem::kFp32: combine_kernel<float><<<grid, kThreads, 0, stream>>>(a); break;
  }
  check_launch("combine");
}

}  // namespace mooncake::kernels::ep_ht
