// The layout pass of a fresh dispatch (api.h: LayoutArgs, launch_layout).
//
// Blocks take chunks of this rank's tokens (chunk_tokens each, one entry of
// topk_idx per thread, copied into the plan's own as it is read) and count,
// per chunk, the tokens sent to each rank and (expanding) those of each
// expert; each token's place within its chunk at every rank (and expert) it
// goes to is written beside. The last block to finish (no block waits for
// another) turns the counts into places before each chunk, tells every peer
// how many tokens it will get (the notify record), waits for every peer's
// record, and lays out what this rank receives: sources in rank order, and
// with do_expand each local expert's rows, padded to the alignment. What a
// peer said it sends is the plan.
#include <cuda_runtime.h>

#include "kernels/common/scan.cuh"
#include "kernels/ep_ht/common.cuh"

namespace mooncake::kernels::ep_ht {
namespace {

struct LayoutShared {
  int32_t id[kThreads];     // a chunk's entries (expert ids, -1: none)
  uint64_t mask[kThreads];  // a chunk's tokens: the ranks each goes to
  int32_t pre[kThreads];    // an entry's place within its warp's tokens at its rank
  int32_t warp_count[kMaxRanks][kWarps];
  int32_t sends[kMaxRanks];  // tokens sent to each rank, all chunks
  int32_t gets[kMaxRanks];   // tokens each rank sends here
  // The last block's plan per local expert: counts, and the padded counts
  // scanned into first rows (kept here, not read back from the plan's words).
  int32_t cnt[kMaxLocalExperts];
  int32_t start[kMaxLocalExperts + 1];
  int32_t warp_total[kWarps];
  bool last;
};
static_assert(kMaxLocalExperts <= 2 * kThreads, "block_exclusive_scan takes two values a thread");

// One chunk: its entries, each token's ranks, the places within the chunk.
__device__ void count_chunk(const LayoutArgs& a, int64_t ch, LayoutShared& sh, int32_t* s_ecnt) {
  const HtRouting& r = a.r;
  const int R = static_cast<int>(a.h.ws.ranks), K = r.topk;
  const int64_t E = r.num_experts, epr = E / R, L = r.chunk_tokens;
  const int i = threadIdx.x, warp = i / 32, lane = i % 32;
  const unsigned below = (1u << lane) - 1;
  const int64_t t0 = ch * L;
  const int nt = static_cast<int>(imin<int64_t>(L, r.num_tokens - t0)), ne = nt * K;

  if (i < ne) {
    // The plan's copy of the entry as it came (the dispatch and combine read it).
    int64_t e = load_idx(r.topk_idx, t0 * K + i, r.topk_int64);
    if (r.topk_int64)
      static_cast<int64_t*>(a.topk_copy)[t0 * K + i] = e;
    else
      static_cast<int32_t*>(a.topk_copy)[t0 * K + i] = static_cast<int32_t>(e);
    if (e < -1 || e >= E) {
      report(a.h.c.status, kStatusBadExpert, static_cast<int>(e), static_cast<int>(t0 + i / K));
      e = -1;
    }
    sh.id[i] = static_cast<int32_t>(e);
    if (e >= 0) atomicAdd(a.etotal + e, 1);
  }
  __syncthreads();
  uint64_t m = 0;
  if (i < nt) {
    for (int k = 0; k < K; ++k) {
      const int e = sh.id[i * K + k];
      if (e < 0) continue;
      for (int k2 = 0; k2 < k; ++k2)
        if (sh.id[i * K + k2] == e) report(a.h.c.status, kHtDuplicate, static_cast<int>(t0 + i), e);
      m |= 1ull << (e / epr);
    }
  }
  // Places within the chunk, per rank: a ballot per rank over the tokens in
  // order, then the warps' counts before each warp.
  for (int d = 0; d < R; ++d) {
    const bool bit = (m >> d) & 1;
    const unsigned bal = __ballot_sync(0xffffffffu, bit);
    if (bit) {
      const int pre = __popc(bal & below);
      for (int k = 0; k < K; ++k) {
        const int e = sh.id[i * K + k];
        if (e >= 0 && e / epr == d) sh.pre[i * K + k] = pre;
      }
    }
    if (lane == 0) sh.warp_count[d][warp] = __popc(bal);
  }
  __syncthreads();
  if (i < R) {
    int run = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int c = sh.warp_count[i][w];
      sh.warp_count[i][w] = run;
      run += c;
    }
    r.chunk_tab[i * r.num_chunks + ch] = run;
  }
  __syncthreads();
  if (i < ne) {
    const int e = sh.id[i];
    r.inpos[t0 * K + i] = e >= 0 ? sh.warp_count[e / epr][(i / K) / 32] + sh.pre[i] : -1;
  }
  if (a.expand) {
    // Places within the chunk, per expert: one warp walks the entries in
    // order (a token selects an expert at most once, so entry order is token
    // order), 32 at a time.
    if (warp == 0) {
      for (int base = 0; base < ne; base += 32) {
        const int j = base + lane;
        const int e = j < ne ? sh.id[j] : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(peers & below);
        const int before = e >= 0 ? s_ecnt[e] : 0;
        __syncwarp();
        if (e >= 0 && rank == 0) s_ecnt[e] = before + __popc(peers);
        __syncwarp();
        if (j < ne) r.inrank[t0 * K + j] = e >= 0 ? before + rank : -1;
      }
    }
    __syncthreads();
    for (int64_t e = i; e < E; e += kThreads) {
      r.chunk_tab[(R + e) * r.num_chunks + ch] = s_ecnt[e];
      s_ecnt[e] = 0;
    }
  }
  __syncthreads();  // the shared arrays are the next chunk's
}

// The last block: places before each chunk, the notify exchange, the plan.
__device__ void finish(const LayoutArgs& a, LayoutShared& sh) {
  const HtRouting& r = a.r;
  const Common& c = a.h.c;
  const int R = static_cast<int>(a.h.ws.ranks), me = c.rank;
  const int64_t E = r.num_experts, epr = E / R, T = r.max_tokens;
  const int i = threadIdx.x, warp = i / 32, lane = i % 32;
  const uint32_t tag = tag_of(c.seq);
  const HtPlan P(R, epr, a.h.ws.channels);
  int32_t* plan = r.plan;
  uint8_t* own = c.peers[me];

  // Counts per chunk -> places before each chunk (exclusive sums, a warp per
  // column, kCols columns at a time: their loads in flight together).
  constexpr int kCols = 4;
  const int64_t cols = R + (a.expand ? E : 0), n = r.num_chunks;
  for (int64_t col0 = warp; col0 < cols; col0 += kWarps * kCols) {
    int carry[kCols] = {};
    for (int64_t b = 0; b < n; b += 32) {
      const bool in = b + lane < n;
      int x[kCols];
#pragma unroll
      for (int u = 0; u < kCols; ++u) {
        const int64_t col = col0 + u * kWarps;
        x[u] = in && col < cols ? r.chunk_tab[col * n + b + lane] : 0;
      }
#pragma unroll
      for (int u = 0; u < kCols; ++u) {
        const int64_t col = col0 + u * kWarps;
        const int incl = warp_inclusive_sum(x[u], lane);
        if (in && col < cols) r.chunk_tab[col * n + b + lane] = carry[u] + incl - x[u];
        carry[u] += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
#pragma unroll
    for (int u = 0; u < kCols; ++u) {
      const int64_t col = col0 + u * kWarps;
      if (lane == 0 && col < R) sh.sends[col] = carry[u];
    }
  }
  __syncthreads();

  // Tell every peer what it gets (a warp each; the flag word last, released).
  for (int d = warp; d < R; d += kWarps) {
    if (d == me || c.peers[d] == nullptr) continue;
    uint8_t* peer = c.peers[d];
    const bool accept = ld_volatile(c.active_ranks + d) != 0;
    if (accept) {
      for (int64_t j = lane; j < epr; j += 32)
        *reinterpret_cast<volatile uint64_t*>(word_at(peer, a.h.ws.notify_word(me, 2 + j))) =
            signal(tag, static_cast<uint32_t>(a.etotal[d * epr + j]));
      if (lane == 0)
        *reinterpret_cast<volatile uint64_t*>(word_at(peer, a.h.ws.notify_word(me, 1))) =
            signal(tag, static_cast<uint32_t>(sh.sends[d]));
    }
    __syncwarp();
    if (lane == 0)
      st_release_sys(word_at(peer, a.h.ws.notify_word(me, 0)),
                     signal(tag, (a.signature & 0x7fffffffu) << 1 | (accept ? 1u : 0u)));
  }

  // Every peer's record (a warp each, all under one deadline).
  const uint64_t deadline = deadline_of(c.timeout_ns);
  for (int s = warp; s < R; s += kWarps) {
    bool good = false;
    int count = 0;
    if (s == me) {
      good = true;
      count = sh.sends[me];
      for (int64_t j = lane; j < epr; j += 32) plan[P.cnt_se(s, j)] = a.etotal[me * epr + j];
    } else {
      bool arrived = false;
      uint64_t flag = 0;
      // (A peer the host has seen gone is masked by this wait, within microseconds.)
      if (lane == 0 && live(c, s)) {
        const uint64_t* w0 = word_at(own, a.h.ws.notify_word(s, 0));
        // A later call's record means the peer went on without this rank (it did
        // not count it in): not taking part, and the record is left for that call.
        const auto ready = [tag](uint64_t v) {
          const uint32_t t = tag_in(v);
          return t == tag || (t != 0 && static_cast<int32_t>(t - tag) > 0);
        };
        arrived = wait_for(c, w0, ready, deadline, s, kRecv, &flag) && tag_in(flag) == tag;
        if (arrived) clear_word(word_at(own, a.h.ws.notify_word(s, 0)));
      }
      // The barrier orders lane 0's acquire before the other lanes' loads of the record.
      __syncwarp();
      arrived = __shfl_sync(0xffffffffu, arrived, 0);
      flag = __shfl_sync(0xffffffffu, flag, 0);
      good = arrived && (flag & 1) != 0;  // it counts this rank in, as this rank counts it
      if (good && ((static_cast<uint32_t>(flag) >> 1) != (a.signature & 0x7fffffffu))) {
        // Another shape of call: neither takes the other's rows (both see it).
        if (lane == 0) report(c.status, kHtMismatch, s, 0);
        good = false;
      }
      bool sound = true;
      if (good) {
        const uint64_t w1 = ld_acquire_sys(word_at(own, a.h.ws.notify_word(s, 1)));
        count = static_cast<int>(static_cast<uint32_t>(w1));
        sound = tag_in(w1) == tag && count >= 0 && count <= T;
        for (int64_t j = lane; j < epr; j += 32) {
          const uint64_t w = ld_acquire_sys(word_at(own, a.h.ws.notify_word(s, 2 + j)));
          const auto v = static_cast<int32_t>(static_cast<uint32_t>(w));
          sound = sound && tag_in(w) == tag && v >= 0 && v <= count;
          plan[P.cnt_se(s, j)] = v;
        }
        sound = __all_sync(0xffffffffu, sound);
        if (!sound && lane == 0) {
          // Another call's words, or corrupt ones: nothing of it is taken.
          report(c.status, kStatusBadCount, s, count);
          mask_peer(c, s, kRecv, kMaskedSilent);
        }
      }
      good = good && sound;
      if (!good) {
        count = 0;
        for (int64_t j = lane; j < epr; j += 32) plan[P.cnt_se(s, j)] = 0;
      }
    }
    if (lane == 0) {
      plan[P.mutual(s)] = good;
      sh.gets[s] = count;
    }
  }
  __syncthreads();

  // The plan: rows per source in rank order, then per local expert.
  if (i == 0) {
    int run = 0;
    for (int s = 0; s < R; ++s) {
      plan[P.src_off(s)] = run;
      run += sh.gets[s];
      a.psum_rank[s] = run;
      plan[P.rows_got(s)] = 0;
    }
    plan[P.src_off(R)] = run;
    plan[HtPlan::kRows] = run;
    plan[HtPlan::kDropped] = 0;
    plan[HtPlan::kAlignment] = static_cast<int32_t>(a.alignment);
  }
  for (int64_t j = i; j < epr; j += kThreads) {
    int cnt = 0;
    for (int s = 0; s < R; ++s) cnt += plan[P.cnt_se(s, j)];
    const auto padded = static_cast<int32_t>((cnt + a.alignment - 1) / a.alignment * a.alignment);
    plan[P.count(j)] = cnt;
    plan[P.padded(j)] = padded;
    a.unaligned[j] = cnt;
    sh.cnt[j] = cnt;
    sh.start[j] = padded;
  }
  __syncthreads();
  block_exclusive_scan(sh.start, static_cast<int>(epr), sh.warp_total);
  for (int64_t j = i; j < epr; j += kThreads) {
    const int first = sh.start[j];
    plan[P.start(j)] = first;
    int run = first;
    for (int s = 0; s < R; ++s) {
      plan[P.ebase(s, j)] = run;
      run += plan[P.cnt_se(s, j)];
    }
    a.psum_expert[j] = a.expand ? first + sh.cnt[j] : sh.start[j + 1];
  }
  if (i == 0) {
    plan[P.start(epr)] = sh.start[epr];
    plan[HtPlan::kExpanded] = sh.start[epr];
  }
  for (int64_t e = i; e < E; e += kThreads) a.etotal[e] = 0;  // zero for the next call
}

__global__ void __launch_bounds__(kThreads, 1) layout_kernel(const LayoutArgs a) {
  extern __shared__ int32_t s_ecnt[];  // expanding: per expert, within the chunk
  __shared__ LayoutShared sh;
  if (a.expand)
    for (int64_t e = threadIdx.x; e < a.r.num_experts; e += kThreads) s_ecnt[e] = 0;
  __syncthreads();
  stamp(a.h, 0);
  for (int64_t ch = blockIdx.x; ch < a.r.num_chunks; ch += gridDim.x)
    count_chunk(a, ch, sh, s_ecnt);
  stamp(a.h, 1);
  if (!last_block(a.h.counter, &sh.last)) return;
  finish(a, sh);
  if (a.h.stamps != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) a.h.stamps[2 * gridDim.x] = now_ns();
  }
}

}  // namespace

void launch_layout(const LayoutArgs& a, int blocks, CUstream_st* stream) {
  MC_CHECK_ARG(a.r.chunk_tokens * a.r.topk <= kThreads && a.r.chunk_tokens >= 1,
               "dispatch: chunks of ", a.r.chunk_tokens, " tokens of ", a.r.topk,
               " entries exceed a block");
  MC_CHECK_ARG(a.h.ws.ranks >= 1 && a.h.ws.ranks <= kMaxRanks, "dispatch: ", a.h.ws.ranks,
               " ranks; the device path takes at most ", kMaxRanks);
  const int64_t grid = imax<int64_t>(1, imin<int64_t>(blocks, a.r.num_chunks));
  const size_t smem = a.expand ? sizeof(int32_t) * a.r.num_experts : 0;
  if (smem + sizeof(LayoutShared) > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess)
      throw_error(ErrorKind::kInvalidArgument, -1, "dispatch: ", a.r.num_experts,
                  " experts need more shared memory than the GPU allows (", cudaGetErrorString(err),
                  ")");
  }
  layout_kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(a);
  check_launch("dispatch (layout)");
}

}  // namespace mooncake::kernels::ep_ht
