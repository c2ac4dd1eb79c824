// The device-driven all_reduce (coll/all_reduce.cu): one launch per op, with
// no host involvement, so that it can be captured in a CUDA graph. Host and
// device share this header: the layout of each rank's area, the per-group
// state in device memory, the launch arguments and the signal words.
//
// Every rank has an area in its device segment, which the others map:
//
//   | control (256 B) | parity 0: input, share | parity 1: input, share |
//
// The control block holds two signals, each `gen << 32 | seq` of the last op
// that reached that point (inputs in place; this rank's two-shot share
// reduced), and per parity the shape word of the op that wrote that parity
// (count, dtype and op, or kShapeRejected). An op numbered `seq` uses parity
// seq & 1. A rank writes a parity again two ops later, and by then it has
// seen every live peer's signal of the op in between, which that peer stored
// only after its launch of this one had ended: no peer still reads it. So no
// launch waits at its end.
//
// A launch (every block resident at once, as the EP kernels' launches):
//  1. copies this rank's input into its area's input;
//  2. block 0 publishes (shape, then the input signal, system-scope release)
//     and waits for each live peer's input signal of this op (bounded by the
//     deadline; a peer the host has seen lost ends the wait at once); a peer
//     whose signal came takes part; the decision goes to every block;
//  3. one-shot: every block reduces its part of the elements from the
//     sources that take part, in rank order, into the output;
//     two-shot: every rank reduces its share (1/R of the elements) into its
//     area's share and the output, publishes the share signal, then copies
//     each other rank's share from that rank's area, or reduces it itself
//     where the share signal does not come (the sources are all still in
//     place: the result is the same bits either way).
//
// Numbering: a launch takes the next op number from the state in device
// memory and stores it back itself, so graph replays count like eager calls;
// the ranks' numbers agree because each makes the same calls in the same
// order. A setup (the first call, and the first after the group's view
// changed: DeviceCollectives::direct_setup) restarts the count at 0 under a
// new generation, which the members agree on in its round on the host (one
// past every member's last), after each has waited for its own earlier
// launches: survivors and a replacement start level, a signal from before (a
// late or left-out process) carries an older generation and is never taken,
// and a launch that meets a newer one knows the others went on without it.
//
// Who takes part is decided once per launch and per peer: a peer is in when
// its input signal of this op came, including when it came just before the
// host saw the peer gone (the wait looks once more after the lost word): its
// input is complete before the signal, and a dead process's memory stays
// readable. So survivors of a crash agree on who took part. A peer masked
// for silence (the deadline passed, or the host saw its heartbeat stand
// still) that is in fact alive may be in at one rank and out at another;
// that is reported (kStatusSilentPeer), not prevented.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "core/hd.h"
#include "kernels/api.h"

struct CUstream_st;

namespace mooncake::kernels {

// Threads per block; blocks per launch at most.
constexpr int kDirectThreads = 512;
constexpr int kDirectMaxBlocks = 32;
// The largest group the state holds (as the host-driven reduction's).
constexpr int kDirectMaxRanks = kMaxReduceSources;

// Status codes of this kernel's own status words (beside the wait helpers'
// kStatusSilentPeer and kStatusNotResident); details: the rank, then a value.
enum DirectStatus : int32_t {
  // A peer's signal carries a newer generation, or an op two ahead: the
  // others went on without this rank (it was left out). Detail: the peer,
  // its generation.
  kStatusDirectStale = 32,
  // A peer's op has another count, dtype or op: it was left out of this one.
  kStatusDirectMismatch = 33,
  // A peer rejected its arguments (it raised ValueError) and took part
  // without data: it was left out of this one.
  kStatusDirectRejected = 34,
};

// A signal: the generation (agreed by the members at each setup) and the
// op's number in it (low 32 bits).
MC_HD inline uint64_t direct_tag(uint32_t gen, uint64_t seq) {
  return (static_cast<uint64_t>(gen) << 32) | (seq & 0xffffffffu);
}
MC_HD inline uint32_t tag_gen(uint64_t tag) {
  return static_cast<uint32_t>(tag >> 32);
}
// How far the tag's op is past op `seq` (mod 2^32; "negative" is far).
MC_HD inline uint32_t tag_ahead(uint64_t tag, uint64_t seq) {
  return static_cast<uint32_t>(tag) - static_cast<uint32_t>(seq);
}
// Whether a wait for op `seq` of generation `gen` may stop at `tag`: it is
// that op or a later one (used when ahead by 0 or 1, see the header), or of
// a newer generation (the others moved on: not used, reported).
MC_HD inline bool tag_settled(uint64_t tag, uint32_t gen, uint64_t seq) {
  const uint32_t g = tag_gen(tag);
  return g > gen || (g == gen && tag_ahead(tag, seq) < 0x80000000u);
}

// The shape word of an op; the peers' must equal it.
MC_HD inline uint64_t direct_shape(size_t count, DType dtype, RedOp op) {
  return (static_cast<uint64_t>(count) << 16) | (static_cast<uint64_t>(dtype) << 8) |
         static_cast<uint64_t>(op);
}
constexpr uint64_t kShapeRejected = ~uint64_t{0};

struct DirectLayout {
  static constexpr size_t kAlign = 256;
  static constexpr size_t kInputSignal = 0;  // uint64
  static constexpr size_t kShareSignal = 8;  // uint64
  static constexpr size_t kShapes = 16;      // uint64 [2], by parity

  // The area of a path serving inputs of up to `max_bytes`.
  static DirectLayout of(size_t max_bytes) {
    DirectLayout l;
    l.max_bytes = max_bytes;
    l.input_bytes = round_up(max_bytes);
    // A share is ceil(count / R) elements rounded up to 16 bytes, R >= 2.
    l.share_bytes = round_up(max_bytes / 2 + 32);
    l.parity_bytes = l.input_bytes + l.share_bytes;
    l.total_bytes = kAlign + 2 * l.parity_bytes;
    return l;
  }
  static constexpr size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  size_t max_bytes = 0;
  size_t input_bytes = 0;
  size_t share_bytes = 0;
  size_t parity_bytes = 0;
  size_t total_bytes = 0;

  MC_HD size_t input(uint64_t seq) const { return kAlign + (seq & 1) * parity_bytes; }
  MC_HD size_t share(uint64_t seq) const { return input(seq) + input_bytes; }
  MC_HD static size_t shape(uint64_t seq) { return kShapes + 8 * (seq & 1); }
};

// Elements of each two-shot share: ceil(count / ranks), rounded up to whole
// 16-byte vectors of `esize`-byte elements (so every share starts aligned).
MC_HD inline size_t direct_share_elems(size_t count, int ranks, size_t esize) {
  const size_t v = 16 / esize;
  const size_t per = (count + static_cast<size_t>(ranks) - 1) / static_cast<size_t>(ranks);
  return (per + v - 1) / v * v;
}

// The group's state, in device memory: written by the host only while no
// launch runs (setup, and a departure's `live` word), read by every launch,
// so a graph captured before a membership change runs with the new table.
struct DirectState {
  uint64_t seq;           // the last launch's op number in this generation
  uint32_t gen;           // the generation its signals carry
  int32_t rank;           // this process's
  int32_t ranks;          // R: entries of the tables below
  uint32_t grid_sync[2];  // the grid barrier's words (zeroed once)
  int32_t* report;        // optional device int32 [R] (the caller's active_ranks): 0 where masked
  uint8_t* areas[kDirectMaxRanks];   // each rank's area as this process maps it (null: none)
  int32_t live[kDirectMaxRanks];     // 1: takes part (a launch masks a lost or silent rank)
  int32_t sources[kDirectMaxRanks];  // this launch's decision (block 0 writes, the grid reads)
};

struct DirectArgs {
  // The wait helpers' view of this launch: peers = state->areas, active_ranks
  // = state->live, the host's lost words, the silent and status words, the
  // per-phase budget and the grid barrier's words.
  Common c;
  DirectState* state;
  DirectLayout layout;
  const void* in;  // this rank's input (may be null when count is 0)
  void* out;       // may be `in`
  size_t count;    // elements
  DType dtype;
  RedOp op;
  // direct_shape(count, dtype, op); kShapeRejected: this rank rejected its
  // arguments and takes part without data (in and out unused).
  uint64_t shape;
  bool two_shot;
  bool vec;  // in and out are 16-byte aligned
};

// Queues one launch of `blocks` blocks on `stream`; returns its cudaError_t.
int launch_direct_all_reduce(const DirectArgs& args, int blocks, CUstream_st* stream);

}  // namespace mooncake::kernels
