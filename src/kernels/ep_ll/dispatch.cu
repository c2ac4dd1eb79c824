// EP low-latency dispatch (api.h: DispatchArgs, launch_dispatch): the send
// phase stages this rank's tokens and tells every expert's owner which rows
// are its; the receive phase pulls its local experts' rows into recv_x.
// ep_ll/common.cuh says how blocks share the work.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/api.h"
#include "kernels/common/convert.cuh"
#include "kernels/common/copy.cuh"
#include "kernels/common/grid.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/scan.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/ep_ll/common.cuh"

namespace mooncake::kernels {
namespace ep_ll {
namespace {

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

// The launch as this block sees it, worked out once at the kernel's start
// and handed to both phases (each phase working it out again gave ptxas a
// different program: other register counts, a few more instructions). The
// phases unpack it by position: the order of the fields is the order of
// their names there.
struct DispatchView {
  const EpLayout& L;
  int R, E, epr, G;
  int64_t T, H;
  int K;
  int64_t entries;  // topk_idx entries: N * K
  int warp, lane;
  unsigned lanes_below;  // this lane's bit mask of the lanes before it
  uint64_t seq;
  uint8_t* own;  // this rank's workspace
};

// Send phase: the grid first puts this rank's tokens into its
// stage, once per token (FP8: quantised there; quantising per destination
// instead made the send phase 6-9 us slower, as it does the work K times at
// low occupancy, and a quantise kernel of its own cost a second launch,
// several us of host time per call; BF16/FP16: copied there, except at world
// 1 in one launch). One pass over topk_idx in flat order gives each selection
// of the block's experts the next slot of its expert (a source's rows reach
// the receiver in token order, as the portable path orders them) and stores
// the row's header there, in the owner's [local expert][this rank] slots.
// After a grid barrier (every block's stage rows are in) the counts are
// published with system-scope releases. `next_id` is this thread's first
// topk_idx entry, which the kernel loaded; s_gen holds the grid barrier's
// generation at arrival.
template <typename Elem, bool kFp8>
__device__ __forceinline__ void dispatch_send(const DispatchArgs& a, const DispatchView& v,
                                              const MaskSnapshot& s_live, int32_t* s_dyn,
                                              int64_t next_id, uint32_t& s_gen) {
  const auto& [L, R, E, epr, G, T, H, K, entries, warp, lane, lanes_below, seq, own] = v;
  // Receivers read this rank's rows from its stage (FP8: quantised there;
  // BF16/FP16: copied there, except in a one-launch call at world 1, whose
  // receive phase reads x itself). Rows other blocks stage are read by
  // other ranks as soon as a count is out, so with peers (or FP8's own
  // rows, read by other blocks of this launch) the blocks meet at a grid
  // barrier before the first count goes out.
  bool staged = true;  // whether every block's stage rows are in
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
  const uint32_t tag = tag_from(a.c, a.c.rank);
  for (int i = threadIdx.x; i < nb; i += kThreads) s_rows[i] = 0;
  for (int64_t round = 0; round < entries; round += kThreads) {
    // The fence, loaded at the round's start (its latency hides behind the
    // slot count), decides the round's header stores into peers.
    const bool open = !s_live.out && !fenced(a.c);
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
      if (slot >= T) {
        report(a.c.status, kStatusOverflow, e, slot + 1);
      } else if (open || e / epr == a.c.rank) {
        *reinterpret_cast<EpMsgHeader*>(a.c.peers[e / epr] + L.header(seq, le, a.c.rank, slot)) =
            EpMsgHeader{t, le, k, tag};
        // The combine finds this selection's expert output by its slot.
        *reinterpret_cast<uint64_t*>(own + L.combine_index(seq, t, k)) =
            (static_cast<uint64_t>(tag) << 32) | static_cast<uint32_t>(slot);
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
  // barrier made visible to the publishing thread. A fence set meanwhile
  // stops the counts to peers.
  const bool open = !s_live.out && !fenced(a.c);
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
    if (!s_live(a.c, e / epr) || (!open && e / epr != a.c.rank)) continue;
    uint8_t* owner = a.c.peers[e / epr];
    const uint64_t count = static_cast<uint64_t>(s_rows[i] < T ? s_rows[i] : T);
    st_release_sys(reinterpret_cast<uint64_t*>(owner + L.dispatch_count(seq, e % epr, a.c.rank)),
                   (static_cast<uint64_t>(tag) << 32) | count);
  }
  __syncthreads();  // s_dyn is the receive phase's next
}

// Receive phase: the block waits for the counts of all its local experts (a
// thread per (expert, source), each with the phase's deadline), lays the
// sources out in rank order, and copies every row's bytes from its source's
// stage (mapped, as the whole workspace is) straight into recv_x, filling
// src_info and layout_range. Pulling the rows moves each selected row once;
// pushing them into the receiver's slots first moved it twice, which
// cost little at world 1 but doubled the bytes when several ranks share a GPU.
template <bool kFp8>
__device__ __forceinline__ void dispatch_recv(const DispatchArgs& a, const DispatchView& v,
                                              const MaskSnapshot& s_live, int32_t* s_dyn,
                                              const uint8_t** s_src, int32_t* s_row) {
  const auto& [L, R, E, epr, G, T, H, K, entries, warp, lane, lanes_below, seq, own] = v;
  // This block receives for local experts blockIdx.x + i * G: it waits for
  // all their counts at once, lays each expert's sources out in rank order
  // and unpacks every row with every warp.
  const int nl = dealt(epr);
  int32_t* s_count = s_dyn;                 // [nl][R]
  int32_t* s_off = s_count + nl * R;        // [nl][R + 1]
  int32_t* s_total = s_off + nl * (R + 1);  // [nl]
  int32_t* s_first = s_total + nl;          // [nl + 1]: each expert's first row in the block's list
  const uint64_t deadline = deadline_of(a.c.timeout_ns);
  const int64_t cols = R * T;
  for (int p = threadIdx.x; p < nl * R; p += kThreads) {
    const int le = static_cast<int>(blockIdx.x) + (p / R) * G, s = p % R;
    uint64_t v = 0;
    int count = 0;
    const auto* sig = reinterpret_cast<const uint64_t*>(own + L.dispatch_count(seq, le, s));
    const uint32_t want = tag_from(a.c, s);  // this call's, from the process mapped at s
    const auto ready = [want](uint64_t x) { return (x >> 32) == want; };
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
      // Of another tag: a late store of a process left out in s's slot (the
      // fence stops those, but not one already past its look), over s's own.
      const bool ok = h.tag == tag_from(a.c, s) && h.local_expert == le && h.token >= 0 &&
                      h.token < T && h.topk_slot >= 0 && h.topk_slot < EpLayout::kMaxTopk &&
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
        // Scales are [E/R, H/128, R*T] in memory (token stride 1, the layout
        // FP8 grouped GEMMs read), handed out transposed to [E/R, R*T, H/128].
        const int64_t nscale = H / EpLayout::kFp8Block;
        float* col = a.recv_scales + (row / cols) * nscale * cols + row % cols;
        for (int64_t j = lane; j < nscale; j += 32)
          col[j * cols] = reinterpret_cast<const float*>(body + H)[j];
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

template <typename Elem, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchArgs a) {
  extern __shared__ int32_t s_dyn[];  // send: counts per (expert, warp); receive: counts, offsets
  __shared__ const uint8_t* s_src[kItems];  // receive: a row's bytes (null: dropped)
  __shared__ int32_t s_row[kItems];         // and its row in recv_x

  const auto [L, R, E, epr, G, T, H] = shape_of(a.c);
  const int K = a.topk;
  const int64_t entries = a.num_tokens * K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1;
  const uint64_t seq = a.c.seq;
  uint8_t* own = a.c.peers[a.c.rank];
  __shared__ MaskSnapshot s_live;
  __shared__ uint32_t s_gen;
  // The send pass's first topk_idx entry, loaded now so that its latency
  // overlaps the mask's (and FP8's quantisation); each round then loads the
  // next round's entry before it works on its own.
  int64_t next_id = (a.c.phases & kSend) && threadIdx.x < entries
                        ? load_idx(a.topk_idx, threadIdx.x, a.topk_int64)
                        : -1;
  s_live.load(a.c, R);
  __syncthreads();
  const DispatchView v{L, R, E, epr, G, T, H, K, entries, warp, lane, lanes_below, seq, own};
  if (a.c.phases & kSend) dispatch_send<Elem, kFp8>(a, v, s_live, s_dyn, next_id, s_gen);
  if (a.c.phases & kRecv) dispatch_recv<kFp8>(a, v, s_live, s_dyn, s_src, s_row);
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
}  // namespace ep_ll

void launch_dispatch(const DispatchArgs& a, CUstream_st* stream) {
  // A bound from when the last warp ran a scan beside the send phase's per-expert
  // sums; that scan went with the pulled rows, but lifting the bound wants a GPU run.
  MC_CHECK_ARG(ep_ll::per_block(a.c.layout.shape.num_experts, a.c.num_blocks) <= kThreads - 32,
               "dispatch: ", a.c.layout.shape.num_experts, " experts over ", a.c.num_blocks,
               " blocks: at most ", kThreads - 32, " experts per block");
  if (a.x_dtype == Dtype::kBf16)
    a.use_fp8 ? ep_ll::dispatch_as<__nv_bfloat16, true>(a, stream)
              : ep_ll::dispatch_as<__nv_bfloat16, false>(a, stream);
  else
    a.use_fp8 ? ep_ll::dispatch_as<__half, true>(a, stream)
              : ep_ll::dispatch_as<__half, false>(a, stream);
  ep_ll::check_launch("dispatch");
}

}  // namespace mooncake::kernels
