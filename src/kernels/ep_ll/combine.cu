// EP low-latency combine (api.h: CombineArgs, launch_combine): the send
// phase hands the expert outputs back to the ranks whose tokens they are; the
// receive phase sums each token's selections into `out`. ep_ll/common.cuh
// says how blocks share the work.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/api.h"
#include "kernels/common/convert.cuh"
#include "kernels/common/copy.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/scan.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/ep_ll/common.cuh"

namespace mooncake::kernels {
namespace ep_ll {
namespace {

// The launch as this block sees it, worked out once at the kernel's start
// and handed to both phases, as in dispatch.cu. The phases unpack it by
// position: the order of the fields is the order of their names there.
struct CombineView {
  const EpLayout& L;
  int R, E, epr, G;
  int64_t T, H;
  int64_t cols;  // rows of one local expert: R * T
  int K;
  int warp, lane;
  uint64_t seq;
  uint32_t tag;  // this rank's tag for the call, as its signals and index entries carry it
  bool both;     // one launch; split, own rows go through the rows region too
  uint8_t* own;  // this rank's workspace
};

// Send phase: the block copies the expert outputs of its (local
// expert, source) pairs from x into this rank's rows region, packed by
// source (nothing to copy when x is that region: the zero-copy buffer), then
// raises one flag per pair at the source, carrying the row where the pair's
// rows start. Packed, a token owner's rows at a peer lie together (about T*K/R
// of them); in recv_x's layout they lie in E/R places R*T rows apart, and
// with 8 ranks on one GPU reading rows from that many places made the
// receive phase 2.4x slower (145 against 60 us; each place its own pages, so
// address translation is the likely cost). s_row and s_dst hold kItems rows
// to copy (in x, in the rows region).
__device__ __forceinline__ void combine_send(const CombineArgs& a, const CombineView& v,
                                             const MaskSnapshot& s_live, int32_t* s_dyn,
                                             int32_t* s_row, int32_t* s_dst) {
  const auto& [L, R, E, epr, G, T, H, cols, K, warp, lane, seq, tag, both, own] = v;
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
  const bool open = !s_live.out && !fenced(a.c);  // a fence set meanwhile stops the flags
  for (int i = threadIdx.x; i < np; i += kThreads) {
    const int p = static_cast<int>(blockIdx.x) + i * G, le = p / R, s = p % R;
    if (!s_live(a.c, s) || (both && s == a.c.rank) || (!open && s != a.c.rank)) continue;
    const int64_t range = a.layout_range[p];
    const uint32_t first =
        (range & 0xffffffff) != 0 ? static_cast<uint32_t>(s_place[i]) : EpLayout::kNoRows;
    st_release_sys(
        reinterpret_cast<uint64_t*>(a.c.peers[s] + L.combine_flag(seq, a.c.rank * epr + le)),
        (static_cast<uint64_t>(tag) << 32) | first);
  }
}

// Receive phase: a block takes its tokens a batch at a time; for each
// selection it waits for the expert's flag, finds the row (that start plus
// the slot the dispatch recorded in the index region) and sums weight * row
// in fp32 straight from the expert owner's workspace, in ascending expert
// order (the portable path's order, so the result is bit-identical), rounded
// once. The shared arrays are the kernel's, [kBatch][kMaxTopk] (s_used:
// [kBatch]).
template <typename Elem>
__device__ __forceinline__ void combine_recv(const CombineArgs& a, const CombineView& v,
                                             const MaskSnapshot& s_live,
                                             float (*s_weight)[EpLayout::kMaxTopk],
                                             int32_t (*s_expert)[EpLayout::kMaxTopk],
                                             int32_t (*s_slot)[EpLayout::kMaxTopk],
                                             const uint8_t* (*s_src)[EpLayout::kMaxTopk],
                                             int32_t* s_used) {
  const auto& [L, R, E, epr, G, T, H, cols, K, warp, lane, seq, tag, both, own] = v;
  // This block sums tokens blockIdx.x + i * G, kBatch at a time: a thread
  // per (token, column) finds its expert output (waiting for the expert's
  // flag, which says where the expert's rows for this rank start; the
  // dispatch recorded the slot), a thread per token orders its columns,
  // then every thread sums (token, 8 channels) units, reading the rows
  // where the experts' owners keep them. One set of barriers per batch, not
  // per token: with several ranks on a GPU a block holds several tokens,
  // and their waits and sorts run side by side.
  const uint64_t deadline = deadline_of(a.c.timeout_ns);
  // Every live peer's flag, whether or not this rank's tokens chose its
  // experts: a peer raises its flags after it read this call's dispatch rows,
  // so once this launch ends no peer still reads this half. Without it a rank
  // whose tokens skip a slow peer could run two calls ahead (hooks) and
  // overwrite the rows and counts that peer has yet to read. The flags were
  // cleared by this call's dispatch, so a graph replay waits for new ones.
  for (int d = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x); d < R;
       d += G * kThreads) {
    if (d == a.c.rank || !s_live(a.c, d)) continue;
    uint64_t v = 0;
    const auto* flag =
        reinterpret_cast<const uint64_t*>(own + L.combine_flag(seq, static_cast<int64_t>(d) * epr));
    const uint32_t want = tag_from(a.c, d);
    wait_for(a.c, flag, [want](uint64_t x) { return (x >> 32) == want; }, deadline, d, kRecv, &v);
  }
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
          const uint32_t want = tag_from(a.c, d);  // from the process mapped at d
          const auto ready = [want](uint64_t x) { return (x >> 32) == want; };
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

  const auto [L, R, E, epr, G, T, H] = shape_of(a.c);
  const int64_t cols = R * T;
  const int K = a.topk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t seq = a.c.seq;
  const uint32_t tag = tag_from(a.c, a.c.rank);
  const bool both = a.c.phases == kBoth;  // split: own rows go through the rows region too
  uint8_t* own = a.c.peers[a.c.rank];
  __shared__ MaskSnapshot s_live;
  s_live.load(a.c, R);
  __syncthreads();
  const CombineView v{L, R, E, epr, G, T, H, cols, K, warp, lane, seq, tag, both, own};
  if (a.c.phases & kSend) combine_send(a, v, s_live, s_dyn, s_row, s_dst);
  if (a.c.phases & kRecv)
    combine_recv<Elem>(a, v, s_live, s_weight, s_expert, s_slot, s_src, s_used);
}

}  // namespace
}  // namespace ep_ll

void launch_combine(const CombineArgs& a, CUstream_st* stream) {
  using ep_ll::combine_kernel;
  const int64_t np =
      ep_ll::per_block(a.c.layout.shape.num_experts, a.c.num_blocks);  // E/R * R pairs
  const size_t smem = sizeof(int32_t) * (4 * np + 1);
  if (a.x_dtype == Dtype::kBf16) {
    ep_ll::allow_smem(combine_kernel<__nv_bfloat16>, smem, "combine");
    combine_kernel<__nv_bfloat16><<<a.c.num_blocks, kThreads, smem, stream>>>(a);
  } else {
    ep_ll::allow_smem(combine_kernel<__half>, smem, "combine");
    combine_kernel<__half><<<a.c.num_blocks, kThreads, smem, stream>>>(a);
  }
  ep_ll::check_launch("combine");
}

}  // namespace mooncake::kernels
