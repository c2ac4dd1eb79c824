// The high-throughput EP kernels (ElasticBuffer, prefill): launch arguments,
// the workspace and plan layouts they share with the device library
// (device/ep_ht.h), and the launchers. Torch-free.
//
// A rank's tokens are cut into C channels (contiguous token ranges, the same C
// on every rank). Each channel is a pipeline through a bounded ring per rank,
// so the workspace does not grow with T:
//
//   dispatch  a sender block stages each token that goes to another rank once
//             into its own ring of channel c (header, expert ids, places,
//             weights, payload); the receiver blocks of every rank it goes to
//             pull the rows they need straight into recv_x (bytes move twice:
//             x -> stage -> recv_x; a rank's own rows go x -> recv_x once);
//   combine   a replier block stages the rows it returns to a source rank in a
//             ring per (source, channel); the source's reducer blocks pull
//             them, sum each token's rows slot by slot in fp32, round once.
//
// Peers only ever store 64-bit signals into each other's workspaces (data is
// always pulled from the owner's memory), so a late writer can corrupt
// nothing but a signal, and every signal carries the call's tag: tails and
// heads are `tag << 32 | count` (bit 31 of the count: the channel is done),
// notify words `tag << 32 | value`. Each signal's reader clears it after its
// last read of a call, before the release that lets the writer go on, so a
// replay of a captured graph (the same tag again) waits for new values.
//
// Rows land where the portable path puts them (python/mooncake/ep/
// throughput_portable.py): sources in rank order, tokens in order; a row's
// place is `src_off[source] + its place among the tokens its source sends
// here`, which the source computes (layout pass) and sends in the row. So
// results are bit for bit the portable path's.
//
// Health: as the low-latency kernels (kernels/common/wait.cuh): a masked
// source is skipped; one the host saw lost, or silent past the deadline of a
// wait (which restarts whenever that peer shows progress), is masked. A
// fresh dispatch drops every row of a source whose rows did not all arrive
// and moves the rows after them up (the portable path's result among the
// rest); a cached dispatch reads them as zero rows with recv_topk_idx -1.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/hd.h"
#include "kernels/api.h"
#include "kernels/common/exports.h"

struct CUstream_st;

namespace mooncake::kernels::ep_ht {

constexpr int kThreads = 512;  // every kernel's block
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 64;               // a token's destinations are a 64-bit mask
constexpr int kMaxTopk = 32;                // K
constexpr int64_t kMaxExperts = 4096;       // E (the per-expert scratch)
constexpr int64_t kMaxLocalExperts = 1024;  // E/R (a notify record's width)
constexpr int kMaxChannels = 256;
// Rows a block moves between two looks at its signals.
constexpr int kBatch = 32;
// Signals: bit 31 of a tail's or head's count says the channel is done.
constexpr uint32_t kDone = 0x80000000u;

// Status codes of this regime beside kernels::StatusCode (the same words).
enum HtStatus : int32_t {
  kHtDuplicate = 32,  // detail: the token, the expert it selects twice
  kHtBadRow = 33,     // detail: the source, the row (past the outputs: corrupt data)
  kHtMismatch = 34,   // detail: the source, 0 (its call's shape is not this rank's)
  kHtShortX = 35,     // detail: a combine's x rows, its layout's valid rows (more: read as 0)
};

// The tag a call's signals carry: 1 .. 2^32 - 1 in turn, never 0 (which a
// cleared word holds), and never the same for consecutive calls (a plain
// truncation would tag calls 2^32 and 2^32 + 1 both 1).
MC_HD inline uint32_t tag_of(uint64_t seq) {
  return static_cast<uint32_t>(seq % 0xffffffffull) + 1u;
}
MC_HD inline uint64_t signal(uint32_t tag, uint32_t value) {
  return (static_cast<uint64_t>(tag) << 32) | value;
}

// One copy (a dispatch's receivers read a source's x where it lies): a
// source's host exports the allocation that holds x (and FP8 scales) through
// CUDA IPC (device/user_memory.h) into an XExport of its workspace; the
// call's XShare says which export and where in it. A dest's host opens an
// export the first time a dispatch offers it (the kernel records the miss,
// and that call stages the bytes as without one copy) and hands its kernels
// the mappings as XImports. The source still stages each row's routing; the
// bytes too until every dest of the channel has answered that it reads x in
// place (a dest slow to answer, or one that cannot, reads them from the ring).
// (The export and import records: kernels/common/exports.h.)
using kernels::kIpcBytes;
using kernels::kXExportBytes;
using kernels::kXSlots;
using kernels::XExport;
using kernels::XImport;

// Where a call's x and scales lie: export `slot` of generation `gen` (0: not
// offered), `off` bytes in; `rows` rows `stride` bytes apart (scales: contiguous).
struct XShare {
  uint32_t gen = 0, slot = 0;
  int64_t off = 0, stride = 0, rows = 0;
  uint32_t sgen = 0, sslot = 0;
  int64_t soff = 0;
};

// The workspace every rank maps: signals, then the rings.
//
//   notify [R sources][kNotifyWords]  a fresh dispatch's record from each
//          source: w0 `signature << 1 | accepts you` (written last, with
//          release), w1 the tokens it sends here, w2.. its tokens per local
//          expert of this rank;
//   xdesc  [R sources][C]  a dispatch's offer of its x (one copy, below): 1
//          offered (its xrec of c says where), 2 not;
//   xack   [R dests][C]    a dest's answer: 1 it reads x itself, 2 stage the bytes;
//   xrec   [C]             this rank's XShare of the call, per channel;
//   xexp   [kXSlots]       this rank's exported allocations (XExport);
//   dtail  [R sources][C]  how many rows a source staged in its ring of c;
//   dhead  [R dests][C]    how many of this rank's staged rows a dest read;
//   ctail  [R repliers][C] how many rows a replier staged for this rank;
//   chead  [R sources][C]  how many of this rank's staged replies a source read;
//   rings  a dispatch: [C][S_d] stage slots; a combine: [R sources][C][S_c]
//          reply slots (never both at once: a rank's calls run in order, and
//          a call ends only when every reader has acknowledged its rows).
struct HtLayout {
  static constexpr int64_t kNotifyWords = 2 + kMaxLocalExperts;
  static constexpr size_t kAlign = 128;

  int64_t ranks = 0;     // R
  int64_t channels = 0;  // C
  size_t notify = 0, xdesc = 0, xack = 0, xrec = 0, xexp = 0, dtail = 0, dhead = 0, ctail = 0,
         chead = 0, rings = 0, total = 0;

  HtLayout() = default;
  HtLayout(int64_t R, int64_t C, size_t ring_bytes) : ranks(R), channels(C) {
    const auto up = [](size_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
    const auto words = [&](int64_t n) { return up(8 * static_cast<size_t>(n)); };
    notify = 0;
    xdesc = notify + words(R * kNotifyWords);
    xack = xdesc + words(R * C);
    xrec = xack + words(R * C);
    xexp = xrec + up(sizeof(XShare) * static_cast<size_t>(C));
    dtail = xexp + up(kXExportBytes * kXSlots);
    dhead = dtail + words(R * C);
    ctail = dhead + words(R * C);
    chead = ctail + words(R * C);
    rings = chead + words(R * C);
    total = rings + up(ring_bytes);
  }
  size_t ring_bytes() const { return total - rings; }

  MC_HD size_t notify_word(int64_t source, int64_t w) const {
    return notify + 8 * static_cast<size_t>(source * kNotifyWords + w);
  }
  MC_HD size_t offer(int64_t source, int64_t c) const {
    return xdesc + 8 * static_cast<size_t>(source * channels + c);
  }
  MC_HD size_t answer(int64_t dest, int64_t c) const {
    return xack + 8 * static_cast<size_t>(dest * channels + c);
  }
  MC_HD size_t share(int64_t c) const { return xrec + sizeof(XShare) * static_cast<size_t>(c); }
  MC_HD size_t exported(int64_t slot) const {
    return xexp + kXExportBytes * static_cast<size_t>(slot);
  }
  MC_HD size_t dispatch_tail(int64_t source, int64_t c) const {
    return dtail + 8 * static_cast<size_t>(source * channels + c);
  }
  MC_HD size_t dispatch_head(int64_t dest, int64_t c) const {
    return dhead + 8 * static_cast<size_t>(dest * channels + c);
  }
  MC_HD size_t combine_tail(int64_t replier, int64_t c) const {
    return ctail + 8 * static_cast<size_t>(replier * channels + c);
  }
  MC_HD size_t combine_head(int64_t source, int64_t c) const {
    return chead + 8 * static_cast<size_t>(source * channels + c);
  }
};

// One call's slots (the same on every rank: a function of the call's shape).
//
// A stage slot: | token, 0, dest mask (16) | ids [K] | places [K] | ranks [K]
// (do_expand) | weights [K] (with weights) | data | scales |, each part 16-byte
// aligned. `places[k]`: the token's place among the tokens this source sends
// the rank of slot k's expert; `ranks[k]`: its place among this source's
// tokens of that expert.
// A reply slot: | weights [K] (with weights) | data |.
struct HtSlots {
  int32_t topk = 0;
  bool weights = false;
  bool expand = false;
  int64_t data_bytes = 0;   // a row's payload (a multiple of 16)
  int64_t scale_bytes = 0;  // FP8 scales (a multiple of 4), 0 without
  int64_t ids = 0, places = 0, ranks = 0, wts = 0, data = 0, scales = 0;  // offsets in a slot
  int64_t bytes = 0;                                                      // a slot
  int64_t count = 0;                                                      // slots per ring (S)

  static constexpr int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

  // A dispatch's stage slots in a workspace of `l`; count 0: they do not fit.
  static HtSlots dispatch(const HtLayout& l, int32_t K, bool weights, bool expand,
                          int64_t data_bytes, int64_t scale_bytes) {
    HtSlots s;
    s.topk = K;
    s.weights = weights;
    s.expand = expand;
    s.data_bytes = data_bytes;
    s.scale_bytes = scale_bytes;
    s.ids = 16;
    s.places = s.ids + up16(4 * K);
    s.ranks = s.places + up16(4 * K);
    s.wts = s.ranks + (expand ? up16(4 * K) : 0);
    s.data = s.wts + (weights ? up16(4 * K) : 0);
    s.scales = s.data + data_bytes;
    s.bytes = up16(s.scales + scale_bytes);
    s.count = l.channels > 0 ? static_cast<int64_t>(l.ring_bytes()) / (l.channels * s.bytes) : 0;
    return s;
  }
  // A combine's reply slots.
  static HtSlots combine(const HtLayout& l, int32_t K, bool weights, int64_t data_bytes) {
    HtSlots s;
    s.topk = K;
    s.weights = weights;
    s.data_bytes = data_bytes;
    s.wts = 0;
    s.data = weights ? up16(4 * K) : 0;
    s.bytes = up16(s.data + data_bytes);
    const int64_t rings = l.ranks * l.channels;
    s.count = rings > 0 ? static_cast<int64_t>(l.ring_bytes()) / (rings * s.bytes) : 0;
    return s;
  }
};

// The least slots a ring may have (a reducer's batch of one token may need K
// rows from one rank; a sender's batch is kBatch rows).
constexpr int64_t kMinSlots = kMaxTopk;

// A fresh dispatch's plan: int32 words on the device, written by the layout
// kernel (and the dispatch's repair), read by later calls along its handle.
// The host reads the summary and padded counts after a CPU sync.
struct HtPlan {
  // summary: rows received, expanded rows (padded), sources dropped by a repair,
  // expert_alignment
  enum : int64_t { kRows = 0, kExpanded = 1, kDropped = 2, kAlignment = 3, kSummary = 4 };
  int64_t R = 0, epr = 0, C = 0;

  MC_HD HtPlan(int64_t ranks, int64_t local_experts, int64_t channels)
      : R(ranks), epr(local_experts), C(channels) {}
  // per local expert: padded counts, counts, first expanded rows (epr + 1)
  MC_HD int64_t padded(int64_t j) const { return kSummary + j; }
  MC_HD int64_t count(int64_t j) const { return kSummary + epr + j; }
  MC_HD int64_t start(int64_t j) const { return kSummary + 2 * epr + j; }
  // per source: first row (R + 1, [R] = the rows received), and whether both
  // count each other in (the portable path's `mutual`)
  MC_HD int64_t src_off(int64_t s) const { return kSummary + 3 * epr + 1 + s; }
  MC_HD int64_t mutual(int64_t s) const { return src_off(R + 1) + s; }
  // per (source, local expert): its tokens, and the first expanded row of them
  MC_HD int64_t cnt_se(int64_t s, int64_t j) const { return mutual(R) + s * epr + j; }
  MC_HD int64_t ebase(int64_t s, int64_t j) const { return cnt_se(R, 0) + s * epr + j; }
  // per (source, channel): the place of its first row and its rows (combine's replies)
  MC_HD int64_t chan_first(int64_t s, int64_t c) const { return ebase(R, 0) + s * C + c; }
  MC_HD int64_t chan_count(int64_t s, int64_t c) const { return chan_first(R, 0) + s * C + c; }
  // per source: the rows that arrived in this call (scratch, zero between calls)
  MC_HD int64_t rows_got(int64_t s) const { return chan_count(R, 0) + s; }
  MC_HD int64_t words() const { return rows_got(R); }
};

enum class Elem : int32_t { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

struct HtCommon {
  // peers, rank, seq, active_ranks, silent, lost, timeout_ns and status as
  // the shared waits (kernels/common/wait.cuh) read them; the rest unused.
  Common c;
  HtLayout ws;
  uint32_t* counter = nullptr;  // device, zero between launches: the last block's ticket
  // Profiling (null: off): device [2 * blocks], each block's %globaltimer (ns)
  // at its start and when its channels are done, in dispatch and combine; the
  // layout pass's at its start and when its chunks are counted, and [2 * grid]
  // when its last block is done ([2 * blocks + 1] then).
  uint64_t* stamps = nullptr;
};

// The tokens of a call and their routing.
struct HtRouting {
  const void* topk_idx = nullptr;  // [N, K] int64 or int32
  bool topk_int64 = true;
  int64_t num_tokens = 0;    // N
  int32_t topk = 0;          // K
  int64_t num_experts = 0;   // E
  int64_t max_tokens = 0;    // T
  int64_t chunk_tokens = 1;  // layout chunks: tokens each
  int64_t num_chunks = 0;
  // [R (+ E when expanding)][chunks]: per chunk the tokens sent to each rank
  // (and of each expert); after the layout pass, the exclusive prefix sums
  // over chunks (the places before each chunk)
  int32_t* chunk_tab = nullptr;
  int32_t* inpos = nullptr;   // [N, K]: the token's place at slot k's rank, within its chunk
  int32_t* inrank = nullptr;  // [N, K] (expanding): its place at slot k's expert, within its chunk
  int32_t* plan = nullptr;    // HtPlan words
};

struct LayoutArgs {
  HtCommon h;
  HtRouting r;  // topk_idx: the caller's entries, copied into topk_copy as they are read
  void* topk_copy = nullptr;  // [N, K], topk_idx's dtype: the plan's own (the handle's)
  int64_t alignment = 1;
  bool expand = false;
  // The call's shape (T, E, K, row bytes, weights, expanding, alignment) as 31
  // bits, in the notify record: ranks whose calls differ take no rows of each other.
  uint32_t signature = 0;
  int32_t* etotal = nullptr;       // device [kMaxExperts] scratch, zero between launches
  int32_t* psum_rank = nullptr;    // [R]
  int32_t* psum_expert = nullptr;  // [E/R]
  int32_t* unaligned = nullptr;    // [E/R]
};

struct DispatchArgs {
  HtCommon h;
  HtRouting r;
  HtSlots slots;
  bool cached = false;   // along a handle's plan: no metadata, failed sources read as zero rows
  bool trimmed = false;  // token rows past the valid ones are cut off after a CPU sync: not zeroed
  const uint8_t* x = nullptr;  // [N] rows of slots.data_bytes, x_stride bytes apart
  int64_t x_stride = 0;
  const uint8_t* scales = nullptr;  // [N, slots.scale_bytes] contiguous, or null
  const float* weights = nullptr;   // [N, K] or null
  uint8_t* recv_x = nullptr;        // [rows, data_bytes]: rows_alloc, or exp_alloc expanding
  uint8_t* recv_scales = nullptr;   // [rows, scale_bytes] or null
  void* recv_idx = nullptr;         // [rows_alloc, K], topk_idx's dtype
  float* recv_w = nullptr;          // [rows_alloc, K], expanding [exp_alloc], or null
  int32_t* metadata = nullptr;      // [rows_alloc, K + 2] (fresh)
  int32_t* dst_slot = nullptr;      // [N, K] (fresh)
  int64_t rows_alloc = 0, exp_alloc = 0;
  int32_t* psum_rank = nullptr;  // the handle's, updated by a repair (fresh)
  int32_t* psum_expert = nullptr;
  int32_t* unaligned = nullptr;
  // One copy (imports null: off, no offers and no answers; on or off alike
  // on every rank, which the layout pass's signature checks). `share`: this
  // rank's offer (gen 0: none); imports [R][kXSlots] this rank's mappings of
  // the peers' exports; misses [R][2] (host-mapped): an offer of x (0) or
  // scales (1) it could not map, `slot << 32 | gen`, for the host; counts [4]
  // (device, or null): (source, channel) pairs read straight from a peer's x,
  // and staged after an offer, in dispatches ([0], [1]) and combines ([2], [3]).
  XShare share;
  const XImport* imports = nullptr;
  uint64_t* misses = nullptr;
  unsigned long long* counts = nullptr;
};

struct CombineArgs {
  HtCommon h;
  HtRouting r;  // the dispatch's
  HtSlots slots;
  bool expand = false;
  bool single = false;  // expanded rows sent one by one (allow_multiple_reduction=False)
  Elem elem = Elem::kBf16;
  const uint8_t* x = nullptr;         // [rows, data_bytes] in the dispatch's layout
  const float* weights = nullptr;     // [rows, K], expanding [rows], or null
  const int32_t* metadata = nullptr;  // the dispatch's [rows_alloc, K + 2]
  int64_t rows = 0;                   // x's rows
  uint8_t* out = nullptr;             // [N, data_bytes]
  float* out_w = nullptr;             // [N, K] or null
  // One copy, as a dispatch's (DispatchArgs), the other way: a replier offers
  // its x (and weights, in `share`'s second part) to each source, with the
  // first of that source's rows (the offer's value: 3 + the row; 2: none),
  // and stages no rows for a source that reads them in place. Plain rows only
  // (no do_expand).
  XShare share;
  const XImport* imports = nullptr;
  uint64_t* misses = nullptr;
  unsigned long long* counts = nullptr;
};

// Queue on `stream`; throw a mooncake::Error when a launch fails.
void launch_layout(const LayoutArgs& a, int blocks, CUstream_st* stream);
void launch_dispatch(const DispatchArgs& a, int blocks, CUstream_st* stream);
void launch_combine(const CombineArgs& a, int blocks, CUstream_st* stream);

}  // namespace mooncake::kernels::ep_ht
