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
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "collectives/communicator.h"
#include "core/dtype.h"
#include "device/cuda.h"
#include "device/peers.h"

namespace mooncake {

class DeviceCollectives {
 public:
  struct Options {
    size_t segment_bytes = 64 << 20;  // each rank's segment: the largest op it serves
    size_t min_bytes = 0;             // smaller ops are left to the host path
    // MOONCAKE_CUDA_SEGMENT_BYTES (0 or MOONCAKE_TRANSPORT=tcp: no device
    // collectives) and MOONCAKE_CUDA_PLANE_MIN_BYTES; nullopt when off.
    static std::optional<Options> from_env();
  };

  // The device collectives of `comm`'s group on `device`: records this
  // process's host in the store (its segment is allocated and published on
  // its first op, so a group that never uses them costs no device memory).
  DeviceCollectives(Communicator& comm, Store& store, std::string prefix, int device,
                    Options options);

  int device() const { return device_; }
  size_t capacity() const { return options_.segment_bytes; }

  // Whether an op whose every rank moves `bytes` (nullopt: sizes that differ
  // between ranks) runs here: every rank of the world on this host, at most
  // kernels::kMaxReduceSources ranks, at least min_bytes, and a segment with
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
  // This rank's segment (allocated and published on the first call).
  uint8_t* mine();
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
  int same_host_ = -1;               // -1: not asked yet
};

}  // namespace mooncake
