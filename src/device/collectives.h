// Collectives on device memory among the ranks of one host: each rank's
// device segment is mapped by the others (peers.h), and every op moves its
// bytes GPU to GPU. An op copies its input into its own segment, the members
// meet in a round of headers (so every input is in place), each reads the
// others' segments with a kernel or a copy, waits for it, and the op's
// commit round says every member is done reading. The host Communicator
// numbers the ops and runs their rounds (Communicator::run_external), so the
// failure semantics are the host path's: an op that a failure interrupts
// re-runs among the survivors from the inputs kept in the segments, every
// survivor returns a result over the same set of ranks, the slices of ranks
// outside it are zero-filled, and a reduction covers that set only.
//
// Every op blocks the calling thread until the device has run it; its work
// is queued on `stream` after whatever the stream holds (the inputs must be
// ready there). Per-rank arrays have one entry per rank of the world size;
// a member that joined past it makes the op raise kInvalidArgument.
// Pointers are device pointers on the collectives' device; inputs and
// outputs are contiguous. timeout_ms as the Communicator's (< 0: its
// default).
//
// Every op also has a device-driven form (direct(), direct_ops.h): one launch
// that reads the members' areas (a part of each segment of its own) with no
// host round, no host wait and no allocation, so that it can be captured in
// a CUDA graph. Its failure semantics are the device's: a peer that dies or
// stays silent is masked by the launch (the survivors of a crash agree on
// who took part, see kernels/coll/direct.h) rather than the op re-run; the
// next op that runs on the host finds the failure and has the survivors
// agree on a view, after which the next device-driven op sets itself up
// again among them.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "collectives/communicator.h"
#include "core/dtype.h"
#include "device/cuda.h"
#include "device/direct_ops.h"
#include "device/peers.h"

namespace mooncake {

class DeviceCollectives {
 public:
  // Whether the device-driven ops run (kOff: none), and all_reduce's
  // algorithm there (kAuto: one-shot at world <= 2 or up to kOneShotBytes,
  // else two-shot).
  enum class Direct { kAuto, kOneShot, kTwoShot, kOff };
  static constexpr size_t kOneShotBytes = 256 << 10;

  struct Options {
    size_t segment_bytes = 64 << 20;  // each rank's segment: the largest op it serves
    size_t min_bytes = 0;             // smaller ops are left to the host path
    // The device-driven ops: their largest input (at most segment_bytes; the
    // segment grows by about 3x this) and all_reduce's algorithm.
    size_t direct_bytes = 8 << 20;
    Direct direct = Direct::kAuto;
    // all_reduce past direct_bytes reads the members' tensors where they lie
    // (mapped_all_reduce), where the device-driven ops are on.
    bool mapped = false;
    // MOONCAKE_CUDA_SEGMENT_BYTES (0 or MOONCAKE_TRANSPORT=tcp: no device
    // collectives), MOONCAKE_CUDA_PLANE_MIN_BYTES, MOONCAKE_CUDA_DIRECT,
    // MOONCAKE_CUDA_DIRECT_BYTES and MOONCAKE_CUDA_MAPPED; nullopt when off.
    static std::optional<Options> from_env();
  };

  // The device collectives of `comm`'s group on `device`: records this
  // process's host in the store (its segment is allocated and published on
  // its first op, so a group that never uses them costs no device memory).
  DeviceCollectives(Communicator& comm, Store& store, std::string prefix, int device,
                    Options options);

  int device() const { return device_; }
  size_t capacity() const { return options_.segment_bytes; }
  const Options& options() const { return options_; }

  // Whether an op whose every rank moves `bytes` (nullopt: sizes that differ
  // between ranks) runs here: every rank of the world on this host, on GPUs
  // with peer access to each other's (a warning names a pair without it, once),
  // at most kernels::kMaxReduceSources ranks, at least min_bytes, and a segment with
  // room for a piece of every rank (kMinRegion bytes each). Any larger size
  // moves through the segment in pieces. Every rank gets the same answer for
  // the same op, so all take the same path.
  bool serves(std::optional<size_t> bytes, int64_t timeout_ms);

  // Ops larger than a segment move in pieces, and a failure re-runs every
  // piece among the survivors, so no op may write its inputs: `in` and `out`
  // differ once `in` is larger than the segment (in_place_ok says when they may
  // be the same), and the root of reduce/broadcast passes a separate output.
  bool in_place_ok(size_t bytes) const { return bytes <= options_.segment_bytes; }

  void all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op,
                  cudaStream_t stream, int64_t timeout_ms = -1);
  // Whether an all_reduce of `count` elements goes through mapped_all_reduce:
  // the option is on, it is past the device-driven bound, the kernels serve
  // its dtype and op and the group (at least two ranks). The same answer at
  // every rank for the same op.
  bool mapped_serves(size_t count, DType dtype, RedOp op, int64_t timeout_ms);
  // all_reduce of `t` in place, each member's tensor read where it lies
  // (kernels/coll/direct.h, the mapped all_reduce): one launch per piece of at
  // most a segment, queued on `stream` after what it holds, none waited for.
  // Each launch serves its piece whatever it finds: in place, or through the
  // segments where a member could not map another's tensor (the exports the
  // launches lacked are mapped before the next call's) or was lost. `queued`:
  // called on the op queue, which sets the kernels up first where they are
  // not; else the caller found mapped_serves() and direct_ready() true.
  // False where the kernels cannot be set up for the view (queued only): the
  // caller runs the op on the plane. `reject` (not null): this rank rejected
  // its arguments and takes part without data (`t` unused; the caller raises
  // it; on the plane too). Raises kTimeout once its launches are queued where
  // an earlier launch wrote nothing at this rank (the others stopped waiting
  // for it: its tensor kept this rank's input), once per such episode.
  bool mapped_all_reduce(void* t, size_t count, DType dtype, RedOp op, cudaStream_t stream,
                         int64_t timeout_ms, bool queued, const char* reject = nullptr);
  // Pieces mapped_all_reduce's finished launches ran in place, and through the
  // segments (a launch that left this rank out counts in neither; tests).
  std::pair<int64_t, int64_t> mapped_pieces();

  // all_reduce whose result only `root` writes (to `out`; others pass null).
  void reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, int root,
              cudaStream_t stream, int64_t timeout_ms = -1);
  // The root reads `in`, the others write `out`.
  void broadcast(const void* in, void* out, size_t count, DType dtype, int root,
                 cudaStream_t stream, int64_t timeout_ms = -1);
  // outs[p] receives rank p's `count` elements.
  void all_gather(const void* in, size_t count, DType dtype, void* const* outs, cudaStream_t stream,
                  int64_t timeout_ms = -1);
  // all_gather into `root`'s outs alone (the others pass null).
  void gather(const void* in, size_t count, DType dtype, void* const* outs, int root,
              cudaStream_t stream, int64_t timeout_ms = -1);
  // Rank p receives `root`'s ins[p] (`count` elements; the others pass null ins).
  void scatter(const void* const* ins, void* out, size_t count, DType dtype, int root,
               cudaStream_t stream, int64_t timeout_ms = -1);
  // ins[p] is this rank's contribution to rank p's shard of `count` elements.
  void reduce_scatter(const void* const* ins, void* out, size_t count, DType dtype, RedOp op,
                      cudaStream_t stream, int64_t timeout_ms = -1);
  // ins[p]/in_counts[p] go to rank p; outs[p]/out_counts[p] come from rank p
  // (elements). Any sizes: an edge larger than a segment's share moves in rounds.
  void all_to_all(const void* const* ins, const size_t* in_counts, void* const* outs,
                  const size_t* out_counts, DType dtype, cudaStream_t stream,
                  int64_t timeout_ms = -1);
  // all_to_all's rule that `rank` sends itself what it expects from itself
  // (kInvalidArgument naming `what`), for callers that check before they queue.
  static void check_own_counts(int rank, const size_t* in_counts, const size_t* out_counts,
                               const char* what);

  // --- the device-driven ops ------------------------------------------------
  using DirectOp = DirectOps::Op;
  // Whether `op` takes them: the options (its input at this rank at most the
  // largest they serve; a rank's input is the same size at every rank, or
  // none), the world (every rank on this host, at most
  // kernels::kDirectMaxRanks). The same answer on every rank for the same op,
  // so all of them take the same path (it waits for the ranks' hosts in the
  // store the first time only).
  bool direct_serves(const DirectOp& op, int64_t timeout_ms);
  // The most elements of each part a launch of `op`'s kind and dtype serves (a
  // multiple of 16; 0: none): an op larger than that can go as one launch per
  // piece of each part (DirectOp::stride).
  size_t direct_chunk(const DirectOp& op) const;
  // Whether a one-rank group takes an op of any size the way it takes theirs
  // (a local copy on the caller's stream, or nothing in place: the caller's
  // job): the device-driven ops are on and the group is this rank alone, with
  // no slot for another to join.
  bool direct_alone(int64_t timeout_ms);
  // Whether a launch needs no host op first: set up for the current view,
  // and this rank not left out. Under capture a caller must check it.
  bool direct_ready();
  // The next launch sets up again first (a host op among the members, which
  // meets a lost member, so that the survivors agree on their view): for a
  // caller that found a launch masked a member. Every rank calls it at the
  // same point of the op queue's order.
  void direct_resync() {
    if (direct_) direct_->invalidate();
  }
  // The largest part an all_to_all with per-pair sizes moves (its rounds of a
  // region of the segment's plane part per rank; 0: none).
  size_t vary_max_part() const;
  // The ranks the last setup took in (bit per slot): a launch's members.
  uint64_t direct_members() const;
  // The device-driven kernels' lost words and life pages (null before the
  // first setup).
  const LostWords* direct_lost_words() const {
    return direct_ ? direct_->lost_words().get() : nullptr;
  }
  // Whether the group re-runs an op among the survivors of a failure (the
  // default, kRecoverRerun): then the device-driven ops' results where a rank
  // fails are the host-driven plane's.
  bool recovers() const { return comm_.config().recover == kRecoverRerun; }
  // `op` queued on `stream` as one device-driven launch; returns without
  // waiting for the device. Where direct_ready() is false it first sets
  // itself up: a host op among the members (each waits for its earlier
  // launches, then they agree on a new generation, which every signal
  // carries, and map each other's areas); where the view does not allow it
  // (a member past the world size) or this rank was left out, the op runs on
  // the host-driven plane instead (blocking). `reject` (not null): this rank
  // rejected its arguments (the caller raises `reject`); it takes part
  // without data, so that the ranks stay in step.
  // `queued` false: the caller is not the op queue (a launch on the caller's
  // stream, maybe under capture), and found direct_ready() after
  // direct_poll(): the launch alone, never a host op.
  void direct(const DirectOp& op, cudaStream_t stream, int64_t timeout_ms = -1,
              const char* reject = nullptr, bool queued = true);
  // Logs what the launches that finished reported (masked ranks, calls that
  // disagreed), and takes it into account: a launch that found the others
  // set up again without this rank makes direct_ready() false.
  void direct_poll();
  // Sets the device-driven ops up where direct_serves(op) (or direct_alone)
  // and they are not ready (as direct() would before its launch), for an op
  // that then runs on the host-driven plane or alone: its eager warm-up
  // readies its capture. Every rank of the op must call it at the same point
  // (it may be a host op).
  void direct_prepare(const DirectOp& op, cudaStream_t stream, int64_t timeout_ms = -1);
  // The ranks `active` (per slot, 1 = member) leaves out are taken out of
  // later launches at once, graph replays included (for a view listener;
  // queued on `stream`).
  void direct_view_changed(const std::vector<uint8_t>& active, cudaStream_t stream);
  // The caller's active_ranks (device int32 [world]): launches zero the ranks
  // they mask there.
  void direct_report_to(int32_t* active_ranks) { report_to_ = active_ranks; }
  // A slot for one eager launch to leave its outcome in (DirectOp::outcome),
  // for a caller that raises what it found, as the plane would.
  DirectOutcomes::Lease direct_watch() { return outcomes_->lease(); }

 private:
  // Piece k of an op covers elements [k * per, k * per + n) of each rank's part.
  struct Piece {
    size_t k, first, n;
  };
  using Move = std::function<void(const Piece& piece, const std::vector<int>& members,
                                  const std::vector<const uint8_t*>& segments)>;
  // The shape every op but all_to_all shares, over `count` elements per part
  // and `per` per piece: `copy_in(piece, segment)` queues this rank's part of
  // the piece into its segment; once every member's is there, `move` queues
  // the op's reads of the members' segments. One piece is copied in before
  // the members meet (its round of headers says it is in place); several take
  // a round each to say so and one to say they were read, and a re-run among
  // survivors copies every piece in again.
  void run(OpType type, DType dtype, RedOp op, int root, size_t count, size_t per,
           cudaStream_t stream, int64_t timeout_ms,
           const std::function<void(const Piece&, uint8_t*)>& copy_in, const Move& move);
  // Elements per piece of an op whose segment holds `parts` parts of `esize`-byte
  // elements (at least 1; the segment's share of each part, whole 256-byte blocks
  // where that leaves room).
  size_t per_piece(size_t parts, size_t esize) const;
  // This rank's segment (allocated and published on the first call), the
  // device-driven ops' area past the first segment_bytes.
  uint8_t* mine();
  // Where that area starts in every segment, and its layout.
  size_t direct_offset() const;
  kernels::DirectLayout direct_layout() const;
  size_t direct_max_bytes() const;
  // The setup of the device-driven ops (its argument: the op that sets it up).
  void direct_setup(const DirectOp& op, cudaStream_t stream, int64_t timeout_ms);
  // Whether the device-driven ops are ready, after a setup where they were
  // not and this rank can take part in one (not left out, the view fits).
  bool direct_set_up(const DirectOp& op, cudaStream_t stream, int64_t timeout_ms);
  // `op` on the host-driven plane (blocking), where direct() cannot launch.
  void direct_on_plane(const DirectOp& op, cudaStream_t stream, int64_t timeout_ms);
  // The blocks a launch of `bytes` takes (a mapped all_reduce's: more).
  int direct_grid(size_t bytes, bool mapped = false);
  // The segments of `members`, in order (this rank's own among them).
  std::vector<const uint8_t*> segments(const std::vector<int>& members, int64_t timeout_ms);
  // Waits until `stream` has run what is queued on it.
  void finish(cudaStream_t stream);
  void check_width(const std::vector<int>& members, const char* op) const;

  Communicator& comm_;
  PeerDirectory directory_;
  const int device_;
  const Options options_;
  std::unique_ptr<DeviceSegment> segment_;
  std::unique_ptr<CudaEvent> done_;  // finish's (made on its first call)
  int mappable_ = -1;                // whether every segment maps here (-1: not asked yet)
  int gpu_sharers_ = 0;              // the world's ranks on this GPU (0: not asked yet)
  // Before direct_, so that no launch outlives the slots it may write (leases
  // keep them too).
  std::shared_ptr<DirectOutcomes> outcomes_;
  std::unique_ptr<DirectOps> direct_;  // made by the first setup
  int32_t* report_to_ = nullptr;
  // The epoch whose view the device-driven ops cannot serve (a member past
  // the world size): its ops run on the host-driven plane.
  uint64_t direct_unfit_epoch_ = UINT64_MAX;
  int sm_share_ =
      0;  // this rank's share of the GPU's SMs, a launch's most blocks (0: not asked yet)
  // The mapped launches whose outcome is not read yet, and the counts of
  // those read (any thread asks).
  struct MappedLaunch {
    DirectOutcomes::Lease lease;
    bool rejected;    // this rank took part without data
    uint64_t number;  // this rank's mapped launches, counted from 1
  };
  std::mutex mapped_mu_;
  std::deque<MappedLaunch> mapped_pending_;
  int64_t mapped_done_ = 0, mapped_planed_ = 0;
  uint64_t mapped_launches_ = 0;
  // The first finished launch that wrote nothing at this rank (0: none), raised
  // by the next call; launches up to mapped_said_ were pending when one was.
  uint64_t mapped_left_ = 0, mapped_said_ = 0;
  void reap_mapped();  // with mapped_mu_ held
  // Work queued on `stream` from now on waits for the last device-driven
  // launch where a mapped all_reduce may have used this rank's segment.
  void after_mapped(cudaStream_t stream);
  bool vary_launched_ = false;  // an all_to_all with per-pair sizes was launched
  // The device-driven launches one after another, on whatever streams (FSDP-style
  // use gathers on one and reduces on another): they share the op count, the grid
  // barrier and the areas' parities.
  std::unique_ptr<LaunchOrder> direct_order_;
};

}  // namespace mooncake
