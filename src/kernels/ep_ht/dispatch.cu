// High-throughput dispatch (api.h: DispatchArgs, launch_dispatch), after the
// layout pass (layout.cu) or along a handle's plan (cached).
//
// Sender blocks stage, channel by channel, each token that goes to another
// rank once into this rank's ring (its routing, then its bytes) and publish
// how far they got to every destination; they reuse a slot only once every
// destination has read past it. Receiver blocks copy this rank's own rows
// from x, then pull the rows meant for them out of every source's ring, a
// batch at a time from whichever source has rows, straight into the outputs
// at the place the source computed. Every block zeroes its share of the
// outputs' rows that no token fills. The last block to finish checks that
// every source's rows all arrived; a fresh dispatch drops those of a source
// whose did not and moves the rest up (repair), a cached one zeroes them.
#include <cuda_runtime.h>

#include "kernels/common/copy.cuh"
#include "kernels/common/scan.cuh"
#include "kernels/ep_ht/common.cuh"

namespace mooncake::kernels::ep_ht {
namespace {

// A channel's streams, one per peer rank.
struct Peers {
  uint32_t cons[kMaxRanks];  // receiver: a source's slots read; sender: a dest's head
  uint32_t tail[kMaxRanks];  // receiver: the slots a source staged
  uint64_t deadline[kMaxRanks];
  int32_t rows[kMaxRanks];   // rows placed from each source in this channel
  int32_t first[kMaxRanks];  // the place of the first of them (-1: none yet)
  int8_t state[kMaxRanks];   // receiver: 1 while reading a source
  bool done[kMaxRanks];
  // receiver: where a source's rows and scales lie, read in place (null: its
  // ring), its row stride and rows
  const uint8_t* xb[kMaxRanks];
  const uint8_t* sb[kMaxRanks];
  int64_t xs[kMaxRanks], xn[kMaxRanks];
  bool in_place[kMaxRanks];  // sender: the dest reads x in place
  int8_t offer[kMaxRanks];   // receiver: the source's offer not yet taken (one copy)
};

// A batch of rows.
struct Batch {
  int32_t row[kBatch];            // its row in the outputs (-1: not one of this rank's)
  int32_t exp[kBatch][kMaxTopk];  // expanding: each slot's row (-1: none)
  const uint8_t* data[kBatch];    // its bytes
  const uint8_t* scales[kBatch];
  uint64_t mask[kBatch];  // sender: the ranks a token goes to
  int32_t slot[kBatch];   // sender: its slot number (-1: not staged)
  int32_t n;
};

// The repair's tables: rows per source and per local expert, before and after.
struct Repair {
  int32_t off_old[kMaxRanks + 1], off_new[kMaxRanks + 1];
  int32_t start_old[kMaxLocalExperts + 1], start_new[kMaxLocalExperts + 1];
  int32_t count_old[kMaxLocalExperts], count_new[kMaxLocalExperts];
  int32_t padded_new[kMaxLocalExperts];
  bool drop[kMaxRanks];
  int32_t map[kThreads];
};

struct Shared {
  Peers p;
  Batch b;
  Repair rep;
  uint64_t dests;   // sender: the ranks it serves
  uint32_t staged;  // sender: slots staged so far
  bool bytes;       // sender: a dest reads the rows' bytes from the ring (or has not answered)
  bool asking;      // sender: a dest's answer to the offer is awaited
  int pick, rr;
  bool any, last;
};

__device__ __forceinline__ void store_idx(void* p, int64_t i, int64_t v, bool is64) {
  if (is64)
    static_cast<int64_t*>(p)[i] = v;
  else
    static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
}

// A row's routing as its source sent it: in the source's stage slot.
struct StagedRow {
  const uint8_t* slot;
  const HtSlots* s;
  __device__ int32_t at(int64_t offset, int k) const {
    return reinterpret_cast<const volatile int32_t*>(slot + offset)[k];
  }
  __device__ int64_t id(int k) const { return at(s->ids, k); }
  __device__ int32_t place(int k) const { return at(s->places, k); }
  __device__ int32_t rank(int k) const { return at(s->ranks, k); }
  __device__ float weight(int k) const {
    return reinterpret_cast<const volatile float*>(slot + s->wts)[k];
  }
};

// This rank's own token t, from topk_idx and the layout pass.
struct OwnRow {
  const DispatchArgs* a;
  int R;
  int64_t epr, t;
  __device__ int64_t id(int k) const { return expert_at(a->r, t, k); }
  __device__ int32_t place(int k) const {
    return place_of(a->r, t, k, static_cast<int>(id(k) / epr));
  }
  __device__ int32_t rank(int k) const { return rank_of(a->r, R, t, k, id(k)); }
  __device__ float weight(int k) const { return a->weights[t * a->r.topk + k]; }
};

// Places row (s, t) and writes its routing outputs (recv_topk_idx, weights,
// metadata); `exp` gets each slot's expanded row. Returns its row, or -1 when
// it has no expert here (or its place is out of bounds: reported). A warp's
// call, lane k for slot k: the slots' loads go out at once, not one after
// another (at world 1, one lane's K dependent rounds were most of a batch's
// time).
template <typename Row>
__device__ int32_t place_row(const DispatchArgs& a, const View& v, const Row& src, int s, int64_t t,
                             int32_t* exp) {
  const int K = v.K, k = v.lane;
  const bool slot = k < K;
  const int64_t e = slot ? src.id(k) : -1;
  const bool here = e >= 0 && e / v.epr == v.me;
  if (slot) exp[k] = -1;
  const unsigned mine = __ballot_sync(0xffffffffu, here);
  if (mine == 0) return -1;
  const int k0 = __ffs(mine) - 1;
  const int32_t first = v.plan[v.P.src_off(s)], count = v.plan[v.P.src_off(s + 1)] - first;
  const int32_t place = __shfl_sync(0xffffffffu, k == k0 ? src.place(k0) : 0, k0);
  if (place < 0 || place >= count || first + place >= a.rows_alloc) {
    if (k == 0) report(a.h.c.status, kHtBadRow, s, place);
    return -1;
  }
  const int64_t row = first + place;
  if (slot) {
    const int64_t local = here ? e - v.me * v.epr : -1;
    store_idx(a.recv_idx, row * K + k, local, a.r.topk_int64);
    int32_t q = -1;
    if (a.slots.expand && local >= 0) {
      const int32_t rank = src.rank(k);
      q = v.plan[v.P.ebase(s, local)] + rank;
      const int32_t end = v.plan[v.P.start(local)] + v.plan[v.P.count(local)];
      if (rank < 0 || q >= end || q >= a.exp_alloc) {
        report(a.h.c.status, kHtBadRow, s, q);
        q = -1;
      }
    }
    exp[k] = q;
    if (!a.cached) a.metadata[row * (K + 2) + 2 + k] = q;
    if (a.recv_w != nullptr) {
      if (!a.slots.expand)
        a.recv_w[row * K + k] = src.weight(k);
      else if (q >= 0)
        a.recv_w[q] = src.weight(k);
    }
  }
  if (!a.cached && k == 0) {
    a.metadata[row * (K + 2)] = static_cast<int32_t>(s * v.T + t);
    a.metadata[row * (K + 2) + 1] = s * K + k0;
  }
  __syncwarp();  // exp is read by other lanes (copy_batch's, after a barrier, or this warp's)
  return static_cast<int32_t>(row);
}

// dst_buffer_slot_idx of this rank's token t (a warp's call, lane k for slot
// k): the rank's slot both count the token in, for the first slot of each rank.
__device__ void own_dst_slots(const DispatchArgs& a, const View& v, int64_t t) {
  const int k = v.lane;
  const int64_t e = k < v.K ? expert_at(a.r, t, k) : -1;
  const int d = e >= 0 ? static_cast<int>(e / v.epr) : -1;
  const SameRank same = same_rank(d, k);
  if (k >= v.K) return;
  int32_t at = -1;
  if (e >= 0 && same.first(k) && v.plan[v.P.mutual(d)] != 0)
    at = static_cast<int32_t>(v.me * v.T + place_of(a.r, t, k, d));
  a.dst_slot[t * v.K + k] = at;
}

// Chunk c of a row, loaded once and stored into every slot's expanded row.
template <bool kFresh>
__device__ void fan_chunk(uint8_t* recv_x, const int32_t* rows, int K, const uint8_t* src,
                          int64_t bytes, int64_t c, int lane) {
  int4 v[kVecs];
  load_chunk<kFresh>(v, src, bytes, c, lane);
  for (int k = 0; k < K; ++k) {
    const int32_t q = rows[k];
    if (q >= 0) store_chunk(recv_x + q * bytes, v, bytes, c, lane);
  }
}

// Every warp copies the batch's rows (kFresh: from a peer's ring, written
// during this launch).
template <bool kFresh>
__device__ void copy_batch(const DispatchArgs& a, const View& v, const Shared& sh, int nb) {
  const int64_t db = a.slots.data_bytes, sb = a.slots.scale_bytes, per_row = chunks_of(db);
  for (int64_t u = v.warp; u < nb * per_row; u += kWarps) {
    const int j = static_cast<int>(u / per_row);
    const int64_t ch = u % per_row;
    const int32_t row = sh.b.row[j];
    if (row < 0) continue;
    if (!a.slots.expand) {
      copy_chunk<kFresh>(a.recv_x + row * db, sh.b.data[j], db, ch, v.lane);
      if (sb != 0 && ch == 0) copy_words(a.recv_scales + row * sb, sh.b.scales[j], sb, v.lane);
    } else {
      fan_chunk<kFresh>(a.recv_x, sh.b.exp[j], v.K, sh.b.data[j], db, ch, v.lane);
      if (sb != 0 && ch == 0)
        for (int k = 0; k < v.K; ++k)
          if (sh.b.exp[j][k] >= 0)
            copy_words(a.recv_scales + sh.b.exp[j][k] * sb, sh.b.scales[j], sb, v.lane);
    }
  }
}

// Warp 0's lanes after placing a batch: the number of rows, and the place of
// the first (the channel's first row from source s, for combine).
__device__ __forceinline__ int note_rows(const View& v, Shared& sh, int s, int32_t row) {
  const unsigned got = __ballot_sync(0xffffffffu, row >= 0);
  if (got != 0) {
    const int32_t first = __shfl_sync(0xffffffffu, row, __ffs(got) - 1);
    if (v.lane == 0 && sh.p.first[s] < 0) sh.p.first[s] = first - v.plan[v.P.src_off(s)];
  }
  return __popc(got);
}

// Source s's offer (its record of channel c): where this rank reads its rows
// in place, or null (it has not mapped them yet, or they are not all there).
__device__ const uint8_t* take_offer(const DispatchArgs& a, const View& v, int s, int c,
                                     Shared& sh) {
  const XShare r = offered_share(a.h.c, a.h.ws, s, c);
  const int64_t db = a.slots.data_bytes, sbytes = a.slots.scale_bytes;
  if (r.stride < db || r.rows < 1 || r.rows > v.T) return nullptr;
  const uint8_t* xb = imported(a, s, r.gen, r.slot, r.off, (r.rows - 1) * r.stride + db, 0);
  const uint8_t* sb = nullptr;
  if (xb != nullptr && sbytes != 0) {
    sb = imported(a, s, r.sgen, r.sslot, r.soff, r.rows * sbytes, 1);
    if (sb == nullptr) return nullptr;
  }
  if (xb != nullptr) {
    sh.p.sb[s] = sb;
    sh.p.xs[s] = r.stride;
    sh.p.xn[s] = r.rows;
  }
  return xb;
}

// Source s's offer of channel c, when in (its thread's call): taken, and
// answered whether this rank reads its x in place (it has it mapped); where
// it lies goes in sh.p.
__device__ void poll_offer(const DispatchArgs& a, const View& v, int s, int c, Shared& sh) {
  auto* w = word_at(v.own, a.h.ws.offer(s, c));
  const uint64_t x = ld_acquire_sys(w);
  if (tag_in(x) != v.tag) return;
  clear_word(w);
  sh.p.offer[s] = 0;
  if (static_cast<uint32_t>(x) != 1) return;  // no offer (its x not exported)
  const uint8_t* xb = take_offer(a, v, s, c, sh);
  sh.p.xb[s] = xb;
  answer(a, v, s, c, xb != nullptr ? 1u : 2u);
  if (a.counts != nullptr) atomicAdd(a.counts + (xb != nullptr ? 0 : 1), 1ull);
}

// Source s masked while its offer is awaited: the offer, if in, taken (a
// replay with this call's tag must not find it), and answered that this rank
// reads none of its rows.
__device__ void refuse_offer(const DispatchArgs& a, const View& v, int s, int c, Shared& sh) {
  auto* w = word_at(v.own, a.h.ws.offer(s, c));
  if (tag_in(ld_acquire_sys(w)) == v.tag) clear_word(w);
  sh.p.offer[s] = 0;
  answer(a, v, s, c, 2u);
}

// The offers of channel c (one copy), a thread per source: those in already
// are answered now, the rest as recv_peers' rounds find them. Nothing waits
// for an offer: a source that has this rank masked never offers, and a wait
// here would hold every other source's ring (which carries the bytes until
// this rank has answered) for a whole timeout, long enough for those sources
// to mask this rank.
__device__ void open_offers(const DispatchArgs& a, const View& v, int c, Shared& sh) {
  const Common& cm = a.h.c;
  const int s = threadIdx.x;
  if (s >= v.R) return;
  sh.p.xb[s] = sh.p.sb[s] = nullptr;
  sh.p.xs[s] = sh.p.xn[s] = 0;
  const bool alive = live(cm, s);  // (read once: it may change under two reads)
  sh.p.offer[s] = a.imports != nullptr && s != v.me && v.plan[v.P.mutual(s)] != 0 && alive;
  if (a.imports != nullptr && s != v.me && cm.peers[s] != nullptr && !alive)
    // Masked here (before this call's layout pass too): should it still offer (it
    // may not have masked this rank), it hears at once that this rank reads none
    // of its rows, in place least of all, and does not wait for an answer by the
    // in-place rule; an offer already in is taken, as any refused one.
    refuse_offer(a, v, s, c, sh);
  if (sh.p.offer[s] != 0) poll_offer(a, v, s, c, sh);
}

// This rank's own tokens of channel c: copied from x. A warp places a token
// at a time; then warp 0 counts the batch's rows while every warp copies.
__device__ void recv_own(const DispatchArgs& a, const View& v, int c, Shared& sh) {
  const Span sp = channel_span(v.N, v.C, c);
  for (int64_t tb = sp.first; tb < sp.end; tb += kBatch) {
    const int nb = static_cast<int>(imin<int64_t>(kBatch, sp.end - tb));
    // Offers that came since: answered now, not after all of this rank's own rows
    // (until then their sources stage the bytes too).
    if (threadIdx.x < v.R && sh.p.offer[threadIdx.x] != 0)
      poll_offer(a, v, static_cast<int>(threadIdx.x), c, sh);
    for (int j = v.warp; j < nb; j += kWarps) {
      const int64_t t = tb + j;
      const OwnRow src{&a, v.R, v.epr, t};
      const int32_t row = place_row(a, v, src, v.me, t, sh.b.exp[j]);
      if (!a.cached) own_dst_slots(a, v, t);
      if (v.lane == 0) {
        sh.b.row[j] = row;
        sh.b.data[j] = a.x + t * a.x_stride;
        sh.b.scales[j] = a.scales != nullptr ? a.scales + t * a.slots.scale_bytes : nullptr;
      }
    }
    __syncthreads();
    if (v.warp == 0) {
      const int n = note_rows(v, sh, v.me, v.lane < nb ? sh.b.row[v.lane] : -1);
      if (v.lane == 0) sh.p.rows[v.me] += n;
    }
    copy_batch<false>(a, v, sh, nb);
    __syncthreads();
  }
}

// The peers' rows of channel c, pulled from their rings (their bytes from
// the source's x once its offer is taken).
__device__ void recv_peers(const DispatchArgs& a, const View& v, int c, Shared& sh) {
  const Common& cm = a.h.c;
  const int tid = threadIdx.x;
  const int64_t S = a.slots.count;
  Peers& p = sh.p;
  if (tid < v.R) {
    const int s = tid;
    p.state[s] = takes_part(cm, v, s);
    p.cons[s] = p.tail[s] = 0;
    p.done[s] = false;
    p.deadline[s] = deadline_of(cm.timeout_ns);
    if (p.state[s] == 0 && p.offer[s] != 0)
      refuse_offer(a, v, s, c, sh);  // masked since open_offers (another block's wait)
    if (p.state[s] == 0 && p.xb[s] != nullptr)
      // Answered "in place", then masked here (another block's wait, while this one
      // took the other offers): it reads nothing, and says so, so that the source's
      // wait for it ends now, not by the in-place rule's two timeouts.
      st_release_sys(word_at(cm.peers[s], a.h.ws.dispatch_head(v.me, c)), signal(v.tag, kDone));
  }
  if (tid == 0) sh.rr = 0;
  __syncthreads();
  for (uint32_t round = 0;; ++round) {
    if (tid < v.R && p.state[tid] != 0) {
      const int s = tid;
      auto* w = word_at(v.own, a.h.ws.dispatch_tail(s, c));
      uint64_t x = 0;
      if (heard(cm, w, v.tag, p.tail[s], p.deadline[s], &x)) p.done[s] = done_in(x);
      // After the tail: the source's thread stores its offer before any tail, so once
      // a tail is seen, so is the offer (and it is answered before the done below).
      if (p.offer[s] != 0) poll_offer(a, v, s, c, sh);
      if (p.tail[s] == p.cons[s]) {
        if (p.done[s]) {
          // Its last word in this call: cleared, then acknowledged.
          clear_word(w);
          st_release_sys(word_at(cm.peers[s], a.h.ws.dispatch_head(v.me, c)),
                         signal(v.tag, p.cons[s] | kDone));
          p.state[s] = 0;
        } else if (gives_up(cm, s, round, p.deadline[s], kRecv)) {
          p.state[s] = 0;
          if (p.offer[s] != 0) refuse_offer(a, v, s, c, sh);  // masked
          if (p.xb[s] != nullptr)  // read in place: the source need not wait for it any more
            st_release_sys(word_at(cm.peers[s], a.h.ws.dispatch_head(v.me, c)),
                           signal(v.tag, p.cons[s] | kDone));
        }
      }
    }
    __syncthreads();
    if (tid == 0)
      pick_peer(
          p.state, v.R, [&p](int s) { return p.tail[s] > p.cons[s]; }, sh.rr, sh.pick, sh.any);
    __syncthreads();
    const int s = sh.pick;
    if (s < 0) {
      if (!sh.any) break;
      __nanosleep(128);
      continue;
    }
    const uint32_t base = p.cons[s];
    const int n = static_cast<int>(imin<uint32_t>(kBatch, p.tail[s] - base));
    for (int j = v.warp; j < n; j += kWarps) {  // a warp a row, as recv_own
      const uint8_t* slot = cm.peers[s] + a.h.ws.rings +
                            (c * S + static_cast<int64_t>((base + j) % S)) * a.slots.bytes;
      // Read once, for the whole warp: the branches below hold warp collectives (a
      // slot a dropped rank reads late may change under it).
      int32_t t32 = 0;
      uint64_t mask = 0;
      if (v.lane == 0) {
        t32 = *reinterpret_cast<const volatile int32_t*>(slot);
        mask = *reinterpret_cast<const volatile uint64_t*>(slot + 8);
      }
      const int64_t t = __shfl_sync(0xffffffffu, t32, 0);
      mask = __shfl_sync(0xffffffffu, mask, 0);
      int32_t row = -1;
      if ((mask >> v.me) & 1) {
        // (a row read in place must be one the source offered)
        if (t < 0 || t >= v.T || (p.xb[s] != nullptr && t >= p.xn[s])) {
          if (v.lane == 0) report(cm.status, kHtBadRow, s, static_cast<int>(t));
        } else {
          const StagedRow src{slot, &a.slots};
          row = place_row(a, v, src, s, t, sh.b.exp[j]);
        }
      }
      if (v.lane == 0) {
        const bool in_place = p.xb[s] != nullptr;  // (t < p.xn[s]: checked above)
        sh.b.row[j] = row;
        sh.b.data[j] = in_place ? p.xb[s] + t * p.xs[s] : slot + a.slots.data;
        sh.b.scales[j] = in_place && p.sb[s] != nullptr ? p.sb[s] + t * a.slots.scale_bytes
                                                        : slot + a.slots.scales;
      }
    }
    __syncthreads();
    if (v.warp == 0) {
      const int got = note_rows(v, sh, s, v.lane < n ? sh.b.row[v.lane] : -1);
      if (v.lane == 0) sh.b.n = got;
    }
    copy_batch<true>(a, v, sh, n);
    __syncthreads();
    if (tid == 0) {
      // The slots are read (the barrier above): the source may reuse them.
      p.cons[s] = base + n;
      p.rows[s] += sh.b.n;
      if (sh.b.n != 0) atomicAdd(v.plan + v.P.rows_got(s), sh.b.n);
      st_release_sys(word_at(cm.peers[s], a.h.ws.dispatch_head(v.me, c)), signal(v.tag, base + n));
    }
    __syncthreads();
  }
}

__device__ void recv_channel(const DispatchArgs& a, const View& v, int c, Shared& sh) {
  const int tid = threadIdx.x;
  if (tid < v.R) {
    sh.p.rows[tid] = 0;
    sh.p.first[tid] = -1;
  }
  open_offers(a, v, c, sh);  // first: the sources stage bytes until every dest answers
  __syncthreads();
  recv_own(a, v, c, sh);
  if (v.R > 1) recv_peers(a, v, c, sh);
  __syncthreads();
  if (!a.cached && tid < v.R) {
    v.plan[v.P.chan_first(tid, c)] = imax<int32_t>(sh.p.first[tid], 0);
    v.plan[v.P.chan_count(tid, c)] = sh.p.rows[tid];
  }
  if (tid == 0 && sh.p.rows[v.me] != 0) atomicAdd(v.plan + v.P.rows_got(v.me), sh.p.rows[v.me]);
  __syncthreads();
}

// Writes a staged token's routing into its slot (a warp's call, lane k for
// slot k, as place_row).
__device__ void stage_routing(const DispatchArgs& a, const View& v, uint8_t* slot, int64_t t,
                              uint64_t mask) {
  const int k = v.lane;
  if (k == 0) {
    *reinterpret_cast<int32_t*>(slot) = static_cast<int32_t>(t);
    *reinterpret_cast<int32_t*>(slot + 4) = 0;
    *reinterpret_cast<uint64_t*>(slot + 8) = mask;
  }
  if (k >= v.K) return;
  const int64_t e = expert_at(a.r, t, k);
  reinterpret_cast<int32_t*>(slot + a.slots.ids)[k] = static_cast<int32_t>(e);
  reinterpret_cast<int32_t*>(slot + a.slots.places)[k] =
      e >= 0 ? place_of(a.r, t, k, static_cast<int>(e / v.epr)) : -1;
  if (a.slots.expand)
    reinterpret_cast<int32_t*>(slot + a.slots.ranks)[k] = e >= 0 ? rank_of(a.r, v.R, t, k, e) : -1;
  if (a.slots.weights) reinterpret_cast<float*>(slot + a.slots.wts)[k] = a.weights[t * v.K + k];
}

// The sender's dests' answers to its offer (state 1: awaited), a thread per
// dest: taken when there (1: it reads x in place; else the ring), and with
// `wait` waited for (a dest that gives up is masked and dropped). Then
// whether the bytes still go into the ring, and whether any answer is awaited.
__device__ void take_answers(const View& v, const HtCommon& h, int c, Shared& sh, bool wait) {
  const int d = threadIdx.x;
  if (d < v.R && sh.p.state[d] == 1 && ((sh.dests >> d) & 1)) {
    auto* w = word_at(v.own, h.ws.answer(d, c));
    uint64_t x = ld_acquire_sys(w);
    bool answered = tag_in(x) == v.tag, finished = false;
    if (!answered && wait) {
      // Rows went out while it had not answered: it may read x in place, so
      // it is waited for by that rule (never dropped on this rank's mask). A
      // dest whose done is in already (it read all, and may since have put a
      // later call's answer in the word, which stays) ends the wait too.
      const uint64_t* hw = word_at(v.own, h.ws.dispatch_head(d, c));
      answered = wait_in_place(
          h.c, w, v.tag, [](uint64_t) { return true; }, d, kSend, &x,
          [&] {
            const uint64_t y = ld_acquire_sys(hw);
            finished = tag_in(y) == v.tag && done_in(y);
            return finished;
          });
      if (finished) {
        // Its answer came before its done (both released): this call's, if the
        // word holds it still, is taken (a replay must not find it).
        x = ld_acquire_sys(w);
        answered = tag_in(x) == v.tag;
      }
      if (!answered && !finished) sh.p.done[d] = true;  // lost: dropped below
    }
    if (answered) {
      clear_word(w);
      sh.p.in_place[d] = static_cast<uint32_t>(x) == 1;
      sh.p.state[d] = sh.p.in_place[d] ? 0 : 2;
    } else if (finished) {  // (the end's wait takes its done, and clears it)
      sh.p.in_place[d] = false;
      sh.p.state[d] = 2;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool bytes = false, asking = false;
    for (int r = 0; r < v.R; ++r) {
      if (sh.p.done[r]) {
        sh.dests &= ~(1ull << r);
        sh.p.done[r] = false;
      }
      if (((sh.dests >> r) & 1) == 0) continue;
      bytes = bytes || sh.p.state[r] != 0;
      asking = asking || sh.p.state[r] == 1;
    }
    sh.bytes = bytes;
    sh.asking = asking;
  }
}

// Sender of channel c: stages the channel's tokens that go to other ranks.
__device__ void send_channel(const DispatchArgs& a, const View& v, int c, Shared& sh) {
  const Common& cm = a.h.c;
  const int tid = threadIdx.x;
  const int64_t S = a.slots.count, db = a.slots.data_bytes, sb = a.slots.scale_bytes;
  const int64_t per_row = chunks_of(db);
  uint8_t* ring = v.own + a.h.ws.rings + c * S * a.slots.bytes;
  if (tid == 0) {
    uint64_t m = 0;
    for (int d = 0; d < v.R; ++d)
      if (takes_part(cm, v, d)) m |= 1ull << d;
    sh.dests = m;
    sh.staged = 0;
  }
  if (tid < v.R) {
    sh.p.cons[tid] = 0;
    sh.p.done[tid] = false;  // here: the dest failed a wait
  }
  // The offer of x (and scales), in this channel's record, then to every dest
  // (one copy on: imports given, on every rank alike). The answers are taken
  // as they come, batch by batch: until every dest has said it reads x in
  // place, the bytes go into the ring too (which serves both), so that a dest
  // slow to answer holds no row back.
  const bool one_copy = a.imports != nullptr, offer = one_copy && a.share.gen != 0;
  if (offer && tid == 0) *reinterpret_cast<XShare*>(v.own + a.h.ws.share(c)) = a.share;
  __syncthreads();
  if (tid < v.R) {
    // here: 1 its answer is awaited, 2 it reads the ring, 0 neither
    sh.p.state[tid] = 0;
    sh.p.in_place[tid] = false;
    if (one_copy && ((sh.dests >> tid) & 1)) {
      st_release_sys(word_at(cm.peers[tid], a.h.ws.offer(v.me, c)), signal(v.tag, offer ? 1u : 2u));
      if (offer) sh.p.state[tid] = 1;
    }
  }
  if (tid == 0) {
    sh.bytes = true;
    sh.asking = offer;
  }
  __syncthreads();
  const Span sp = channel_span(v.N, v.C, c);
  for (int64_t tb = sp.first; tb < sp.end; tb += kBatch) {
    const int nb = static_cast<int>(imin<int64_t>(kBatch, sp.end - tb));
    __syncthreads();  // every warp has read the last batch's count (a batch may stage none)
    if (sh.asking) {  // (block-uniform)
      take_answers(v, a.h, c, sh, false);
      __syncthreads();
    }
    if (v.warp == 0) {
      uint64_t m = 0;
      if (v.lane < nb)
        for (int k = 0; k < v.K; ++k) {
          const int64_t e = expert_at(a.r, tb + v.lane, k);
          if (e >= 0 && ((sh.dests >> (e / v.epr)) & 1)) m |= 1ull << (e / v.epr);
        }
      const unsigned bal = __ballot_sync(0xffffffffu, m != 0);
      sh.b.mask[v.lane] = m;
      sh.b.slot[v.lane] =
          m != 0 ? static_cast<int32_t>(sh.staged + __popc(bal & ((1u << v.lane) - 1))) : -1;
      if (v.lane == 0) sh.b.n = __popc(bal);
    }
    __syncthreads();
    const int n = sh.b.n;
    const uint32_t staged = sh.staged;
    if (n == 0) continue;
    // Room: every dest has read up to the slots these rows reuse.
    const int64_t need = static_cast<int64_t>(staged) + n - S;
    if (need > 0) {
      if (tid < v.R && ((sh.dests >> tid) & 1) && sh.p.cons[tid] < need) {
        uint64_t x = 0;
        // (a dest that gave up on this rank says it is done: it reads no more)
        const auto ready = [tag = v.tag, need](uint64_t w) {
          return tag_in(w) == tag && (count_in(w) >= need || done_in(w));
        };
        auto* w = word_at(v.own, a.h.ws.dispatch_head(tid, c));
        // A dest that reads (or may read: not answered yet) x in place is
        // waited for by that rule: dropped, it might read on after the call.
        const bool got = sh.p.in_place[tid] || sh.p.state[tid] == 1
                             ? wait_in_place(cm, w, v.tag, ready, tid, kSend, &x)
                             : wait_for(cm, w, ready, deadline_of(cm.timeout_ns), tid, kSend, &x);
        if (got && !done_in(x)) {
          sh.p.cons[tid] = count_in(x);
        } else {                   // masked (or lost), or done early: it reads no more
          if (got) clear_word(w);  // (its last word in this call: not one for a replay)
          sh.p.done[tid] = true;
        }
      }
      __syncthreads();
      // (nothing reads the dests again before the barrier after the copies)
      if (tid == 0)
        for (int d = 0; d < v.R; ++d)
          if (sh.p.done[d]) {
            sh.dests &= ~(1ull << d);
            sh.p.done[d] = false;
          }
    }
    for (int j = v.warp; j < nb; j += kWarps)
      if (sh.b.slot[j] >= 0)
        stage_routing(a, v, ring + (sh.b.slot[j] % S) * a.slots.bytes, tb + j, sh.b.mask[j]);
    for (int64_t u = v.warp; sh.bytes && u < nb * per_row; u += kWarps) {
      const int j = static_cast<int>(u / per_row);
      if (sh.b.slot[j] < 0) continue;
      const int64_t t = tb + j, ch = u % per_row;
      uint8_t* slot = ring + (sh.b.slot[j] % S) * a.slots.bytes;
      copy_chunk<false>(slot + a.slots.data, a.x + t * a.x_stride, db, ch, v.lane);
      if (sb != 0 && ch == 0) copy_words(slot + a.slots.scales, a.scales + t * sb, sb, v.lane);
    }
    __syncthreads();
    // Every thread's stores are in (the barrier): a release publishes them.
    if (tid == 0) sh.staged = staged + n;
    if (tid < v.R && ((sh.dests >> tid) & 1))
      st_release_sys(word_at(cm.peers[tid], a.h.ws.dispatch_tail(v.me, c)),
                     signal(v.tag, staged + n));
    __syncthreads();
  }
  // The end: every dest hears the total first (a dest that reads the ring has
  // all it needs), then the answers not yet taken are (each its word's last read
  // in this call), and every dest acknowledges the total (having read it all and
  // cleared its word), so this channel's words are free for the next call.
  const uint32_t total = sh.staged;
  if (tid < v.R && ((sh.dests >> tid) & 1))
    st_release_sys(word_at(cm.peers[tid], a.h.ws.dispatch_tail(v.me, c)),
                   signal(v.tag, total | kDone));
  // A dest that never answers is dropped once lost (host, life page) or a whole
  // timeout past its last progress: were it only slow, it could still take the
  // offer late and read x in place after this call (withdrawing an offer would
  // need a system-scope compare-and-swap between the processes).
  if (sh.asking) {  // (block-uniform)
    __syncthreads();
    take_answers(v, a.h, c, sh, true);
    __syncthreads();
  }
  // A dest that reads x in place is waited for as long as it reads (x must stay).
  if (tid < v.R && ((sh.dests >> tid) & 1)) {
    const int d = tid;
    auto* w = word_at(v.own, a.h.ws.dispatch_head(d, c));
    uint64_t x = 0;
    if (sh.p.in_place[d])
      wait_done_in_place(cm, w, v.tag, d, kSend, &x);
    else
      wait_done(cm, w, v.tag, d, kSend, &x);
    clear_word(w);
  }
  __syncthreads();
}

__device__ void zero_row(uint8_t* dst, int64_t bytes, int lane) {
  auto* d = reinterpret_cast<int4*>(dst);
  for (int64_t i = lane; i < bytes / 16; i += 32) d[i] = int4{0, 0, 0, 0};
}

// A token row that holds no token: zero data, -1 ids and metadata.
__device__ void clear_token_row(const DispatchArgs& a, const View& v, int64_t r, bool metadata) {
  for (int k = v.lane; k < v.K; k += 32) store_idx(a.recv_idx, r * v.K + k, -1, a.r.topk_int64);
  if (metadata)
    for (int k = v.lane; k < v.K + 2; k += 32) a.metadata[r * (v.K + 2) + k] = -1;
  if (!a.slots.expand) {
    zero_row(a.recv_x + r * a.slots.data_bytes, a.slots.data_bytes, v.lane);
    if (a.recv_scales != nullptr)
      zero_words(a.recv_scales + r * a.slots.scale_bytes, a.slots.scale_bytes, v.lane);
    if (a.recv_w != nullptr)
      for (int k = v.lane; k < v.K; k += 32) a.recv_w[r * v.K + k] = 0.0f;
  }
}

// An expanded row that holds no token (padding).
__device__ void clear_expanded_row(const DispatchArgs& a, const View& v, int64_t q) {
  zero_row(a.recv_x + q * a.slots.data_bytes, a.slots.data_bytes, v.lane);
  if (a.recv_scales != nullptr)
    zero_words(a.recv_scales + q * a.slots.scale_bytes, a.slots.scale_bytes, v.lane);
  if (a.recv_w != nullptr && v.lane == 0) a.recv_w[q] = 0.0f;
}

// Whether expanded row q holds a token in the layout of `start`/`count` (epr experts).
__device__ __forceinline__ bool expanded_valid(const int32_t* start, const int32_t* count, int epr,
                                               int64_t q) {
  if (q >= start[epr]) return false;
  const int j = find_segment(start, epr, static_cast<int>(q));
  return q - start[j] < count[j];
}

// The rows no token fills, zeroed by the receivers, a warp a row.
__device__ void zero_rest(const DispatchArgs& a, const View& v, int b, int blocks) {
  const int64_t gw = static_cast<int64_t>(b) * kWarps + v.warp, warps = int64_t{blocks} * kWarps;
  const int64_t M = v.plan[HtPlan::kRows];
  if (!a.trimmed)
    for (int64_t r = M + gw; r < a.rows_alloc; r += warps) clear_token_row(a, v, r, !a.cached);
  if (!a.slots.expand) return;
  const int32_t* start = v.plan + v.P.start(0);
  const int32_t* count = v.plan + v.P.count(0);
  // (trimmed: the rows past the layout's end are cut off after the CPU sync, not zeroed;
  // alone, exp_alloc is the worst case, which may be far past it)
  const int64_t end = a.trimmed ? imin<int64_t>(a.exp_alloc, start[v.epr]) : a.exp_alloc;
  for (int64_t q = gw; q < end; q += warps)
    if (!expanded_valid(start, count, static_cast<int>(v.epr), q)) clear_expanded_row(a, v, q);
}

// --- the last block ----------------------------------------------------------------

__device__ int32_t token_map(const Repair& rs, int R, int32_t r) {
  const int s = find_segment(rs.off_old, R, r);
  return rs.drop[s] ? -1 : r - rs.off_old[s] + rs.off_new[s];
}

__device__ int32_t expanded_map(const Repair& rs, const View& v, int32_t q) {
  const int epr = static_cast<int>(v.epr);
  if (q < 0 || q >= rs.start_old[epr]) return -1;
  const int j = find_segment(rs.start_old, epr, q);
  if (q - rs.start_old[j] >= rs.count_old[j]) return -1;  // padding
  int32_t base = rs.start_new[j];
  for (int s = 0; s < v.R; ++s) {
    const int32_t eb = v.plan[v.P.ebase(s, j)], n = v.plan[v.P.cnt_se(s, j)];
    if (q < eb + n) return rs.drop[s] ? -1 : q - eb + base;
    if (!rs.drop[s]) base += n;
  }
  return -1;
}

// Moves rows [r0, r0 + n) of a [rows, cols] array of U to rs.map's rows, in
// place: each thread owns columns and walks the rows in increasing order, and
// a row only moves to a row at or before its own (read already).
template <typename U>
__device__ void move_rows(U* p, int64_t cols, int32_t r0, int n, const int32_t* map) {
  for (int64_t col = threadIdx.x; col < cols; col += kThreads)
    for (int i = 0; i < n; ++i) {
      const int32_t to = map[i];
      if (to >= 0 && to != r0 + i) p[to * cols + col] = p[(r0 + i) * cols + col];
    }
}

// A fresh dispatch whose source's rows did not all arrive (it died, or was
// masked, during the call): that source counts as having sent nothing, as the
// portable path drops its rows; the rows after it move up, and the plan and
// the handle's counts follow. Rare, so one block does it.
__device__ void repair(const DispatchArgs& a, const View& v, Shared& sh) {
  Repair& rs = sh.rep;
  const int tid = threadIdx.x, R = v.R, epr = static_cast<int>(v.epr), K = v.K;
  const int32_t align = v.plan[HtPlan::kAlignment];
  if (tid <= R) rs.off_old[tid] = v.plan[v.P.src_off(tid)];
  __syncthreads();
  if (tid < R) {
    const int s = tid;
    const int32_t count = rs.off_old[s + 1] - rs.off_old[s];
    const bool drop = s != v.me && v.plan[v.P.mutual(s)] != 0 && v.plan[v.P.rows_got(s)] != count;
    rs.drop[s] = drop;
    if (drop) mask_peer(a.h.c, s, kRecv, kMaskedSilent);  // a no-op when masked already
  }
  __syncthreads();
  if (tid == 0) {
    bool any = false;
    int32_t run = 0;
    for (int s = 0; s < R; ++s) {
      rs.off_new[s] = run;
      if (rs.drop[s])
        any = true;
      else
        run += rs.off_old[s + 1] - rs.off_old[s];
    }
    rs.off_new[R] = run;
    sh.any = any;
  }
  __syncthreads();
  if (!sh.any) return;
  for (int j = tid; j < epr; j += kThreads) {
    rs.count_old[j] = v.plan[v.P.count(j)];
    rs.start_old[j] = v.plan[v.P.start(j)];
    int32_t n = 0;
    for (int s = 0; s < R; ++s)
      if (!rs.drop[s]) n += v.plan[v.P.cnt_se(s, j)];
    rs.count_new[j] = n;
    rs.padded_new[j] = (n + align - 1) / align * align;
  }
  if (tid == 0) rs.start_old[epr] = v.plan[v.P.start(epr)];
  __syncthreads();
  if (v.warp == 0) warp_exclusive_scan(rs.padded_new, rs.start_new, epr, v.lane);
  __syncthreads();

  // Token rows, then expanded rows, a tile of kThreads rows at a time.
  const int64_t db = a.slots.data_bytes, sb = a.slots.scale_bytes;
  const int64_t isz = a.r.topk_int64 ? 8 : 4;
  const int32_t M_old = rs.off_old[R], M_new = rs.off_new[R];
  for (int32_t r0 = 0; r0 < M_old; r0 += kThreads) {
    const int n = imin<int32_t>(kThreads, M_old - r0);
    if (tid < n) rs.map[tid] = token_map(rs, R, r0 + tid);
    __syncthreads();
    move_rows(static_cast<uint32_t*>(a.recv_idx), K * isz / 4, r0, n, rs.map);
    // metadata: its expanded rows move too
    for (int col = tid; col < K + 2; col += kThreads)
      for (int i = 0; i < n; ++i) {
        const int32_t to = rs.map[i];
        if (to < 0) continue;
        int32_t x = a.metadata[static_cast<int64_t>(r0 + i) * (K + 2) + col];
        if (col >= 2 && a.slots.expand && x >= 0) x = expanded_map(rs, v, x);
        a.metadata[static_cast<int64_t>(to) * (K + 2) + col] = x;
      }
    if (!a.slots.expand) {
      move_rows(reinterpret_cast<int4*>(a.recv_x), db / 16, r0, n, rs.map);
      if (a.recv_scales != nullptr)
        move_rows(reinterpret_cast<uint32_t*>(a.recv_scales), sb / 4, r0, n, rs.map);
      if (a.recv_w != nullptr) move_rows(a.recv_w, K, r0, n, rs.map);
    }
    __syncthreads();
  }
  if (a.slots.expand) {
    const int32_t total = rs.start_old[epr];
    for (int32_t q0 = 0; q0 < total; q0 += kThreads) {
      const int n = imin<int32_t>(kThreads, total - q0);
      if (tid < n) rs.map[tid] = expanded_map(rs, v, q0 + tid);
      __syncthreads();
      move_rows(reinterpret_cast<int4*>(a.recv_x), db / 16, q0, n, rs.map);
      if (a.recv_scales != nullptr)
        move_rows(reinterpret_cast<uint32_t*>(a.recv_scales), sb / 4, q0, n, rs.map);
      if (a.recv_w != nullptr) move_rows(a.recv_w, 1, q0, n, rs.map);
      __syncthreads();
    }
  }
  // What no longer holds a token.
  for (int64_t r = M_new + v.warp; r < M_old; r += kWarps) clear_token_row(a, v, r, true);
  if (a.slots.expand)
    for (int64_t q = v.warp; q < rs.start_old[epr]; q += kWarps)
      if (!expanded_valid(rs.start_new, rs.count_new, epr, q)) clear_expanded_row(a, v, q);
  __syncthreads();

  // The plan and the handle's counts, as the layout pass would have made them.
  for (int j = tid; j < epr; j += kThreads) {
    int32_t run = rs.start_new[j];
    for (int s = 0; s < R; ++s) {
      v.plan[v.P.ebase(s, j)] = run;
      if (rs.drop[s])
        v.plan[v.P.cnt_se(s, j)] = 0;
      else
        run += v.plan[v.P.cnt_se(s, j)];
    }
    v.plan[v.P.count(j)] = rs.count_new[j];
    v.plan[v.P.padded(j)] = rs.padded_new[j];
    v.plan[v.P.start(j)] = rs.start_new[j];
    a.unaligned[j] = rs.count_new[j];
    a.psum_expert[j] = a.slots.expand ? rs.start_new[j] + rs.count_new[j] : rs.start_new[j + 1];
  }
  if (tid <= R) v.plan[v.P.src_off(tid)] = rs.off_new[tid];
  if (tid < R) {
    a.psum_rank[tid] = rs.off_new[tid + 1];
    if (rs.drop[tid]) {
      v.plan[v.P.mutual(tid)] = 0;
      for (int c = 0; c < v.C; ++c) v.plan[v.P.chan_count(tid, c)] = 0;
    }
  }
  if (tid == 0) {
    int dropped = 0;
    for (int s = 0; s < R; ++s) dropped += rs.drop[s];
    v.plan[v.P.start(epr)] = rs.start_new[epr];
    v.plan[HtPlan::kRows] = M_new;
    v.plan[HtPlan::kExpanded] = rs.start_new[epr];
    v.plan[HtPlan::kDropped] = dropped;
  }
}

// A cached dispatch: a source whose rows did not all arrive reads as zero
// rows of no expert, as on the portable path.
__device__ void zero_failed(const DispatchArgs& a, const View& v) {
  for (int s = 0; s < v.R; ++s) {
    const int32_t first = v.plan[v.P.src_off(s)], end = v.plan[v.P.src_off(s + 1)];
    if (s == v.me || v.plan[v.P.mutual(s)] == 0 || v.plan[v.P.rows_got(s)] == end - first) continue;
    if (threadIdx.x == 0) mask_peer(a.h.c, s, kRecv, kMaskedSilent);  // a no-op when masked
    for (int64_t r = first + v.warp; r < end; r += kWarps) clear_token_row(a, v, r, false);
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchArgs a) {
  __shared__ Shared sh;
  const View v = view_of(a);
  const Roles roles = roles_of(v.R);
  stamp(a.h, 0);
  if (roles.sends()) {
    for (int c = roles.index(); c < v.C; c += roles.count()) send_channel(a, v, c, sh);
  } else {
    for (int c = roles.index(); c < v.C; c += roles.count()) recv_channel(a, v, c, sh);
    zero_rest(a, v, roles.index(), roles.count());
  }
  stamp(a.h, 1);
  if (!last_block(a.h.counter, &sh.last)) return;
  if (a.cached)
    zero_failed(a, v);
  else
    repair(a, v, sh);
  __syncthreads();
  if (threadIdx.x < v.R) v.plan[v.P.rows_got(threadIdx.x)] = 0;  // zero for the next call
}

}  // namespace

void launch_dispatch(const DispatchArgs& a, int blocks, CUstream_st* stream) {
  const int64_t R = a.h.ws.ranks;
  MC_CHECK_ARG(R >= 1 && R <= kMaxRanks, "dispatch: ", R, " ranks; the device path takes at most ",
               kMaxRanks);
  MC_CHECK_ARG(a.r.topk >= 1 && a.r.topk <= kMaxTopk, "dispatch: num_topk ", a.r.topk,
               " is outside [1, ", kMaxTopk, "]");
  MC_CHECK_ARG(a.r.num_experts / R <= kMaxLocalExperts, "dispatch: ", a.r.num_experts / R,
               " local experts; the device path takes at most ", kMaxLocalExperts);
  MC_CHECK_ARG(a.slots.data_bytes % 16 == 0 && a.slots.scale_bytes % 4 == 0, "dispatch: rows of ",
               a.slots.data_bytes, " bytes and scales of ", a.slots.scale_bytes,
               " bytes must be multiples of 16 and 4");
  MC_CHECK_ARG(R == 1 || (blocks >= 2 && a.slots.count >= kMinSlots), "dispatch: ", blocks,
               " blocks and ", a.slots.count, " ring slots; with peers at least 2 and ", kMinSlots);
  dispatch_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  check_launch("dispatch");
}

}  // namespace mooncake::kernels::ep_ht
