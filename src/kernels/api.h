// The launch arguments and launchers of every device kernel, torch-free: the
// device library (src/device) fills these structs from its callers' pointers
// and launches on their streams. The kernels live by regime: coll/ (the CUDA backend's
// reduction), ep_ll/ (low-latency EP dispatch and combine), with their
// shared device helpers in common/.
//
// EP (ep_ll/): dispatch and combine over workspaces that every rank maps
// (device/ipc.h), placed by EpLayout.
//
// Each call has a sequence number `seq` (>= 1, the same on every rank for the
// same call); its half of the workspace is seq & 1 and its signals carry it,
// with the writer's fence key (EpLayout::tag_of): a receiver takes a signal
// or header from rank r only with the tag of this call and of the process it
// maps at r (Common::keys).
//
// Fence: a process its peers left out (a resumed or late kernel) must not
// store into their workspaces. Its peers then set the fence word in its
// workspace (Common::fence, device/ep.h); a launch that finds it set stores
// into no peer (every peer counts as masked) and reports kStatusLeftOut, and
// one that is past that point looks again right before each phase that
// stores into peers (headers, counts, combine flags). A kernel that looked
// before the word was set may still store until its next look; the tags keep
// whatever it stores from being taken for a newer process's.
// A call runs in phases: kSend stages this rank's rows in its own workspace
// and publishes them (signals stored into the peers' workspaces); kRecv
// waits for the peers' signals and pulls their rows from their workspaces. Both phases in one
// launch is the usual call; split, the send half returns at once and the receive half runs later
// (return_recv_hook).
//
// Health: a source whose active_ranks entry (or slot_mask entry) is 0 when a
// wait starts is skipped at once; one that stays silent past the phase's
// deadline is set to 0 there (atomically) and counts as having sent nothing. Each phase has its
// own budget, so a slow first phase never starves the second. Bad values
// (expert ids out of range, more than T rows for one expert) are dropped and
// reported in `status`, which the host reads without a sync.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "ep/layout.h"

struct CUstream_st;

namespace mooncake::kernels {

enum Phase : int32_t { kSend = 1, kRecv = 2, kBoth = 3 };
enum class Dtype : int32_t { kBf16 = 0, kFp16 = 1 };

// Status words (device-written, host-mapped): the first error wins.
enum StatusCode : int32_t {
  kStatusOk = 0,
  kStatusBadExpert = 1,    // detail: the expert id, the token
  kStatusOverflow = 2,     // detail: the expert, its rows
  kStatusBadHeader = 3,    // detail: the source rank, the local expert
  kStatusBadCount = 4,     // detail: the source rank, the count
  kStatusSilentPeer = 5,   // detail: the rank masked for silence, the phase
  kStatusNotResident = 6,  // detail: the blocks that arrived, the grid size
  kStatusLeftOut = 7,      // the fence word was set: this process's peers left it out
};
constexpr int kStatusWords = 4;  // code, detail 0, detail 1, timeouts so far

// Why a wait masked a rank, in its silent word (Common::silent).
enum MaskReason : int32_t {
  kMaskedSilent = 1,  // its signal did not come by the deadline
  kMaskedLost = 2,    // the host saw it lost (Common::lost)
};

struct Common {
  EpLayout layout;
  uint8_t* const* peers;  // device [R]: every rank's workspace as this rank maps it
  int32_t rank;
  uint64_t seq;
  int32_t* active_ranks;  // device int32 [R], 1 = healthy
  // Optional (null: none) device int32 [R], 1 = active: an elastic buffer's
  // slot mask, in force beside active_ranks (a rank takes part when both say
  // so; a silent one is set to 0 in both).
  int32_t* slot_mask;
  // Optional host-mapped int32 [R]: a MaskReason for every rank a launch
  // masked (the status words keep only the first report).
  int32_t* silent;
  // Optional host-mapped int32 [R], written by the host: 1 for a rank whose
  // process the host has seen gone, 2 for one whose heartbeat stands still
  // past the hang limit. A wait on such a rank ends within microseconds
  // instead of at the deadline; the silent word then says kMaskedLost.
  const int32_t* lost;
  // Optional (null: none; given with `lost`), host-mapped uint64 [R]: the
  // device address of each rank's life word (0: none), a word the Linux
  // kernel marks (FUTEX_OWNER_DIED) the moment that rank's process dies
  // (LostWords::watch_life). Read beside `lost` by a wait that has lasted
  // 50 us (kernels/common/wait.cuh): a death ends it even where this host's
  // notice comes late.
  const uint64_t* life;
  // Given with `lost` (LostWords::into): device uint64 [R], zeroed,
  // each rank's word as last read ((time the read was issued, ns) << 2 | word;
  // word 3: clear, and its life word read too: kernels/common/wait.cuh),
  // and one claim word ((start ns) << 1 | 1 while a read is out). A GPU serves
  // reads of host memory one at a time for all its SMs (about 1 us each on an
  // H100: 132 blocks reading at once wait 130 us each; bench/micro), so the
  // waits read this copy, and one thread at a time of the kernels that share
  // it (a buffer's) refreshes it, a word per read (kernels/common/wait.cuh).
  uint64_t* lost_seen;
  uint64_t* lost_claim;
  // Device uint32 [R]: the tag byte of the process mapped at each rank (this
  // one's own at `rank`; 1..255, from its fence key: EpBuffer::write_keys):
  // its signals' and headers' tags carry it.
  const uint32_t* keys;
  // Device, in this process's workspace's control block: nonzero once its
  // peers left it out (see Fence above).
  const int32_t* fence;
  int64_t timeout_ns;   // per wait phase
  int32_t* status;      // kStatusWords ints, host-mapped
  uint32_t* grid_sync;  // device, 2 words, zeroed once: the grid barrier's count and generation
  int32_t phases;       // Phase bits
  int32_t num_blocks;   // grid size; every block must be resident at once
};

struct DispatchArgs {
  Common c;
  const void* x;  // [N, H] of x_dtype
  Dtype x_dtype;
  int64_t num_tokens;    // N <= T
  const void* topk_idx;  // [N, K], int64 or int32
  bool topk_int64;
  int32_t topk;  // K <= EpLayout::kMaxTopk
  bool use_fp8;
  void* recv_x;           // [E/R, R*T, H] of x_dtype, or e4m3 with FP8
  float* recv_scales;     // [E/R, H/128, R*T] (token stride 1) with FP8, else null
  int32_t* recv_count;    // [E/R]
  int32_t* src_info;      // [E/R, R*T]: source token per row, -1 past recv_count
  int64_t* layout_range;  // [E/R, R]: offset << 32 | count per source
  int32_t* stats;         // [E/R] cumulative tokens received, or null
};

struct CombineArgs {
  Common c;
  const void* x;  // [E/R, R*T, H] expert outputs in recv_x's layout (or the rows region)
  Dtype x_dtype;
  const int64_t* layout_range;
  int64_t num_tokens;    // N of the dispatch
  const void* topk_idx;  // [N, K]
  bool topk_int64;
  int32_t topk;
  const float* topk_weights;  // [N, K] float32
  void* out;                  // [N, H] of x_dtype
};

// Launch on `stream`; throw a mooncake::Error when the launch fails.
void launch_dispatch(const DispatchArgs& args, CUstream_st* stream);
void launch_combine(const CombineArgs& args, CUstream_st* stream);

// Threads per block of both EP kernels (the host sizes grids with it).
constexpr int kThreads = 512;

// The CUDA backend's reduction (coll/reduce.cu): out = sources combined in
// order, with the same arithmetic as the host's reduce_arrays
// (collectives/reduce.h): fp16 and bf16 accumulate in fp32 and are rounded
// once, integers wrap around, MIN and MAX propagate NaN, AVG divides the sum
// once. So the device plane and the host path give bit-identical results, and
// so does every rank (each reduces the same sources in the same order).
constexpr int kMaxReduceSources = 64;

struct ReduceArgs {
  const void* srcs[kMaxReduceSources];  // nsrc device pointers (this rank's or mapped)
  int nsrc = 0;
  void* out = nullptr;  // may be one of srcs
  size_t count = 0;     // elements
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int avg_divisor = 1;
};

// Queues the reduction on `stream`; returns the launch's cudaError_t (0: queued).
int launch_reduce(const ReduceArgs& args, CUstream_st* stream);

}  // namespace mooncake::kernels
