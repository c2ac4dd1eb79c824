// The device-driven collectives (coll/direct.cu): one launch per op, with no
// host involvement, so that an op can be captured in a CUDA graph. Host and
// device share this header: the layout of each rank's area, the per-group
// state in device memory, the launch arguments and the signal words.
//
// Every op is the same meeting: each rank puts its input in its own area,
// says so, and reads what it needs from the others' areas (DirectKind says
// what). Every rank has an area in its device segment, which the others map:
//
//   | control (256 B) | parity 0: input, share | parity 1: input, share |
//
// The control block holds two signals, each `gen << 32 | seq` of the last op
// that reached that point (inputs in place; this rank's two-shot share
// reduced), and per parity the shape word of the op that wrote that parity
// (kind, root, count, dtype and op, or kShapeRejected). An op numbered `seq`
// uses parity seq & 1. A rank writes a parity again two ops later, and by
// then it has seen every live peer's signal of the op in between, which that
// peer stored only after its launch of this one had ended: no peer still
// reads it. So no launch waits at its end. Every rank of every op publishes
// and waits (a broadcast's receivers too): that is what makes the reuse safe.
//
// A launch (every block resident at once, as the EP kernels' launches):
//  1. copies this rank's input into its area's input (none for a broadcast
//     or scatter at a rank other than the root);
//  2. block 0 publishes (shape, then the input signal, system-scope release)
//     and waits for each live peer's input signal of this op (bounded by the
//     deadline; a peer the host has seen lost ends the wait at once); a peer
//     whose signal came takes part; the decision goes to every block;
//  3. the op's reads, every block its part of each: a reduction sums the
//     sources that take part in rank order; a move copies each part from the
//     area it comes from, or zero-fills it when that rank is out (the
//     host-driven plane's rule for the slices of ranks outside the op).
//     all_reduce, one-shot: every element from every source; two-shot: every
//     rank reduces its share (1/R of the elements) into its area's share and
//     the output, publishes the share signal, then copies each other rank's
//     share from that rank's area, or reduces it itself where the share
//     signal does not come (the sources are all still in place: the result
//     is the same bits either way).
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
// Who takes part is decided once per launch and per peer, alike at every
// survivor: a peer is in when its input signal of this op came (its input is
// complete before it, and a dead process's memory stays readable). A rank
// that stops waiting for a peer (the deadline passed, the host saw it lost,
// or the view retired it) looks once more and, when the signal has not come,
// swaps a fence in for it (compare-and-swap over the value it read); a rank
// publishes its signal by compare-and-swap too, never over a fence of its
// generation nor a newer generation's word. So the signal and the fence
// cannot both land (peers on other GPUs need native atomics over their
// link, as NVLink has): a peer killed while its kernel still runs (the GPU ends
// a dead process's work some time after its peers see it gone) is in at
// every survivor or out at every one, and so is a slow rank that is alive,
// which stays out until the next setup, its own results leaving its input
// out too (kStatusDirectFenced). What stays reported, not prevented: a slow
// rank that the others lapped by two ops (they went on without waiting for
// it, and its reads of their areas may be torn) leaves them out of the ops
// it was behind in (kStatusDirectStale).
//
// The mapped all_reduce (DirectArgs::mapped: eager, in place, past the bound
// of the areas' inputs) reads the members' tensors where they lie, each
// mapped through CUDA IPC (kernels/common/exports.h): no input is copied. A
// launch publishes its offer (which export holds its tensor, and where) with
// its shape, before its input signal, and the members are decided as above.
// Then each member reduces its share (1/n of the elements, the n members in
// rank order) from every member's tensor into its own area, writing no
// tensor, and publishes by compare-and-swap, on its mapped signal, whether it
// could (it maps every member's export; a miss is left for its host to map).
// Every member waits for every other's mapped signal and seals it where it
// does not come (a fence, as for the input signal), so every survivor finds
// the same set landed. Where every member's landed saying it reduced, each
// copies every share from its owner's area into its tensor, the op's only
// write to a tensor (every read of the tensors was over before). Else (a
// member could not map another's tensor: a first call with a new
// allocation; or a member was lost) the launch serves the op itself, on the
// tensors, which nothing has written yet: each member whose mapped signal
// landed copies its tensor into its segment's host-driven part (idle during
// the launch: the plane's ops end with every member done reading it), says
// so on its copied signal (sealed where it does not come, as above), sums
// every copied member's segment in rank order into its tensor, and says it
// is done reading on its done signal, waited for before the launch ends (so
// no later op overwrites a segment still read). The set that copied is the
// op's: a member lost before it copied is left out at every survivor, one
// lost after at none (its segment stays readable). So the caller never waits
// for the launch and never runs the op again: the launch gives every
// survivor the same result whichever way it went. A member that dies after
// its mapped signal landed left its share whole in its area, read as a live
// one's. Bytes a member moves in place: N read and N/n written (its share), N
// read and N written (the shares): 3N + N/n, against the plane's (3 + R) N;
// through the segments 2N + nN + N.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "core/hd.h"
#include "kernels/api.h"
#include "kernels/common/exports.h"

struct CUstream_st;

namespace mooncake::kernels {

// Threads per block; blocks per launch at most.
constexpr int kDirectThreads = 512;
constexpr int kDirectMaxBlocks = 32;
// A mapped all_reduce's (below): it moves a large op's bytes, at the memory's
// rate only with most of this process's share of the GPU.
constexpr int kDirectMaxMappedBlocks = 128;
// The largest group the state holds (as the host-driven reduction's).
constexpr int kDirectMaxRanks = kMaxReduceSources;

// What an op reads. `count` (DirectArgs) is the elements of one rank's part:
// of the input and the output of all_reduce, reduce and broadcast; of the
// input of all_gather and gather (whose output holds R parts, rank p's at
// p * count); of the output of reduce_scatter and scatter (whose input holds
// R parts, the one for rank p at p * count); of each of the R parts of
// all_to_all's input and output (part p of the input goes to rank p; part p
// of the output comes from rank p).
enum class DirectKind : uint8_t {
  kAllReduce = 0,
  kReduce = 1,  // the root writes the reduction; the others only give theirs
  kBroadcast = 2,
  kAllGather = 3,
  kGather = 4,  // all_gather whose output only the root writes
  kReduceScatter = 5,
  kScatter = 6,  // the root's input parts, one to each rank
  kAllToAll = 7,
};
constexpr int kDirectKinds = 8;

MC_HD constexpr bool direct_reduces(DirectKind k) {
  return k == DirectKind::kAllReduce || k == DirectKind::kReduce || k == DirectKind::kReduceScatter;
}
// Parts of `count` elements in this rank's input and output (R ranks); the
// rank's role (root or not) matters for broadcast, reduce, gather, scatter.
MC_HD constexpr size_t direct_in_parts(DirectKind k, int ranks, bool root) {
  switch (k) {
    case DirectKind::kBroadcast: return root ? 1 : 0;
    case DirectKind::kReduceScatter:
    case DirectKind::kAllToAll: return static_cast<size_t>(ranks);
    case DirectKind::kScatter: return root ? static_cast<size_t>(ranks) : 0;
    default: return 1;
  }
}
MC_HD constexpr size_t direct_out_parts(DirectKind k, int ranks, bool root) {
  switch (k) {
    case DirectKind::kReduce: return root ? 1 : 0;
    case DirectKind::kAllGather:
    case DirectKind::kAllToAll: return static_cast<size_t>(ranks);
    case DirectKind::kGather: return root ? static_cast<size_t>(ranks) : 0;
    default: return 1;
  }
}
// Whether the kind has a root (its shape word names it; others carry 0).
MC_HD constexpr bool direct_rooted(DirectKind k) {
  return k == DirectKind::kReduce || k == DirectKind::kBroadcast || k == DirectKind::kGather ||
         k == DirectKind::kScatter;
}

// Status codes of this kernel's own status words (beside the wait helpers'
// kStatusSilentPeer and kStatusNotResident); details: the rank, then a value.
enum DirectStatus : int32_t {
  // A peer's signal carries a newer generation, or an op two ahead: the
  // others went on without this rank (it was left out). Detail: the peer,
  // its generation.
  kStatusDirectStale = 32,
  // A peer's op has another kind, root, count, dtype or op: it was left out
  // of this one.
  kStatusDirectMismatch = 33,
  // A peer rejected its arguments (it raised ValueError) and took part
  // without data: it was left out of this one.
  kStatusDirectRejected = 34,
  // A peer stopped waiting for this rank and fenced its signal: every rank,
  // this one too, leaves its input out until the next setup. Detail: the op
  // the fence keeps it out of, from then on.
  kStatusDirectFenced = 35,
  // A peer stopped waiting for this rank at one of a mapped all_reduce's own
  // signals: this rank wrote nothing, and its tensor holds its input. Detail:
  // this rank, the op.
  kStatusDirectMappedOut = 36,
  // A peer stopped waiting for this rank's reads of the segments in a mapped
  // all_reduce (its done signal was fenced): its result may be torn. Detail:
  // this rank, the op.
  kStatusDirectMappedLate = 37,
  // Two members of an all_to_all with per-pair sizes disagree on the sizes
  // between them (what one sends, the other expects): nothing moved, every
  // member raises. Detail: the two ranks.
  kStatusDirectSizes = 38,
};

// A signal: the generation (agreed by the members at each setup, below 2^31)
// and the op's number in it (low 32 bits); the top bit marks a fence.
constexpr uint64_t kFenceBit = uint64_t{1} << 63;
MC_HD inline uint64_t direct_tag(uint32_t gen, uint64_t seq) {
  return (static_cast<uint64_t>(gen) << 32) | (seq & 0xffffffffu);
}
// The fence a rank at op `seq` swaps in for a peer's signal of op seq - 1 (a
// rank reaches op seq only once it took that one or fenced it before).
MC_HD inline uint64_t direct_fence(uint32_t gen, uint64_t seq) {
  return kFenceBit | direct_tag(gen, seq);
}
MC_HD inline uint32_t tag_gen(uint64_t tag) {
  return static_cast<uint32_t>(tag >> 32) & 0x7fffffffu;
}
// The signal a word stands for: a fence of op f stands for the signal it
// replaced, op f - 1's (ops before f took the peer, f and later do not).
MC_HD inline uint64_t tag_signal(uint64_t tag) {
  if ((tag & kFenceBit) == 0) return tag;
  return direct_tag(tag_gen(tag), static_cast<uint32_t>(tag) - 1u);
}
// How far the tag's op is past op `seq` (mod 2^32; "negative" is far).
MC_HD inline uint32_t tag_ahead(uint64_t tag, uint64_t seq) {
  return static_cast<uint32_t>(tag_signal(tag)) - static_cast<uint32_t>(seq);
}
// Whether a wait for op `seq` of generation `gen` may stop at `tag`: it is
// that op or a later one (used when ahead by 0 or 1, see the header), or of
// a newer generation (the others moved on: not used, reported).
MC_HD inline bool tag_settled(uint64_t tag, uint32_t gen, uint64_t seq) {
  const uint32_t g = tag_gen(tag);
  return g > gen || (g == gen && tag_ahead(tag, seq) < 0x80000000u);
}
// Whether `tag` is a fence set in generation `gen` (an older one's is void).
MC_HD inline bool tag_fence_of(uint64_t tag, uint32_t gen) {
  return (tag & kFenceBit) != 0 && tag_gen(tag) == gen;
}
// Whether `tag` is a fence of generation `gen` that keeps its rank out of op
// `seq`.
MC_HD inline bool tag_fenced(uint64_t tag, uint32_t gen, uint64_t seq) {
  return tag_fence_of(tag, gen) && !tag_settled(tag, gen, seq);
}

// A mapped op's own signals (its mapped, copied and done words) are fenced
// per op: a fence keeps its rank out of the op it names, not of the later
// ones (membership is the input signal's), so a rank once slow there takes
// part again in the next op. Whether `tag` is such a fence of generation
// `gen` at op `seq` or a later one (one of an earlier op is a word its rank
// publishes over).
MC_HD inline bool tag_fenced_from(uint64_t tag, uint32_t gen, uint64_t seq) {
  return tag_fence_of(tag, gen) && static_cast<uint32_t>(static_cast<uint32_t>(tag) -
                                                         static_cast<uint32_t>(seq)) < 0x80000000u;
}

// The shape word of an op; the peers' must equal it. Counts below 2^36 (a
// part's bytes fit the area, DirectOps checks).
constexpr size_t kDirectMaxCount = size_t{1} << 36;
// `two_shot` (all_reduce's algorithm) is in it too: ranks that chose
// differently leave each other out at once, rather than wait for a share
// that never comes.
// `mapped` (all_reduce reading the members' tensors in place, below) too, in
// the root's top bit (a root is below kDirectMaxRanks, 64). all_to_all with
// per-pair sizes (DirectArgs::vary) has count 0 and the two-shot bit set: a
// rank that calls it meets one that calls the equal-parts form as a mismatch.
MC_HD inline uint64_t direct_shape(DirectKind kind, int root, size_t count, DType dtype, RedOp op,
                                   bool two_shot = false, bool mapped = false) {
  return (static_cast<uint64_t>(count) << 28) | (static_cast<uint64_t>(mapped) << 27) |
         (static_cast<uint64_t>(root & 0x7f) << 20) | (static_cast<uint64_t>(two_shot) << 19) |
         (static_cast<uint64_t>(kind) << 16) | (static_cast<uint64_t>(dtype) << 8) |
         static_cast<uint64_t>(op);
}
constexpr uint64_t kShapeRejected = ~uint64_t{0};

struct DirectLayout {
  static constexpr size_t kAlign = 256;
  static constexpr size_t kInputSignal = 0;    // uint64
  static constexpr size_t kShareSignal = 8;    // uint64
  static constexpr size_t kShapes = 16;        // uint64 [2], by parity
  static constexpr size_t kOffers = 32;        // uint64 [2][2], by parity: a mapped op's offer
  static constexpr size_t kMappedSignal = 64;  // uint64: a mapped op's share is in the area
  static constexpr size_t kMappedOk = 72;      // uint64 [2], by parity: 1 reduced, 0 could not
  // uint64 signals of a mapped op served through the segments: its tensor
  // copied into the segment; its reads of the others' segments done.
  static constexpr size_t kMappedCopied = 88;
  static constexpr size_t kMappedDone = 96;
  // uint64 word of an all_to_all with per-pair sizes (vary_word): the last
  // round this rank read in full (its puts are per receiver: VaryTable::put).
  static constexpr size_t kVaryRead = 104;

  // The area of a path serving inputs of up to `max_bytes` (a whole input:
  // every part of a reduce_scatter's, all_to_all's or scatter's).
  static DirectLayout of(size_t max_bytes) {
    DirectLayout l;
    l.max_bytes = max_bytes;
    l.input_bytes = round_up(max_bytes);
    // A share is ceil(count / R) elements rounded up to 16 bytes, R >= 2.
    l.share_bytes = round_up(max_bytes / 2 + 32);
    l.parity_bytes = l.input_bytes + l.share_bytes;
    l.exports = kAlign + 2 * l.parity_bytes;
    l.total_bytes = l.exports + round_up(kXSlots * kXExportBytes);
    return l;
  }
  MC_HD static constexpr size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  size_t max_bytes = 0;
  size_t input_bytes = 0;
  size_t share_bytes = 0;
  size_t parity_bytes = 0;
  size_t exports = 0;  // the table of this rank's exported tensors (kXSlots XExports)
  size_t total_bytes = 0;

  MC_HD size_t input(uint64_t seq) const { return kAlign + (seq & 1) * parity_bytes; }
  MC_HD size_t share(uint64_t seq) const { return input(seq) + input_bytes; }
  MC_HD static size_t shape(uint64_t seq) { return kShapes + 8 * (seq & 1); }
  MC_HD static size_t offer(uint64_t seq) { return kOffers + 16 * (seq & 1); }
  MC_HD static size_t mapped_ok(uint64_t seq) { return kMappedOk + 8 * (seq & 1); }
};

// An all_to_all with per-pair sizes (DirectArgs::vary). Parts may be of any
// size, so each goes through a region per receiver in rounds: round k holds
// bytes [k * region, (k + 1) * region) of every part, and a pair takes as many
// rounds as its part needs (a rank loops over the most any of its pairs needs).
// Each rank publishes, in its area's input of the op's parity, a table: the
// region's size, where its regions lie (0: in that input, past the table,
// protected by the parity as the other kinds' inputs; else how far before the
// area its segment lies: in the segment's host-driven part, for parts past the
// area's regions, read back before the launch ends), the bytes it sends and
// expects from each rank, and a put word per receiver. Every member reads
// every member's table once its input signal came; a pair whose sizes disagree
// (either way) voids the op at every member. Round 0 is in place before the
// input signal; a later round's parts go in once their receiver said it read
// the round before (DirectLayout::kVaryRead), and are said to be in by that
// receiver's put word (a receiver a sender stopped serving never sees it
// move). Both kinds of word are vary_word(gen, seq, round).
struct VaryTable {
  // Bytes of the table for `ranks` (a whole number of vectors, 256 B aligned).
  MC_HD static constexpr size_t bytes(int ranks) {
    return DirectLayout::round_up(8 * (2 + 3 * static_cast<size_t>(ranks)));
  }
  // Word indices: region, where, then sends [ranks], expects [ranks], puts [ranks].
  MC_HD static constexpr size_t send(int p) { return 2 + static_cast<size_t>(p); }
  MC_HD static constexpr size_t expect(int ranks, int p) {
    return 2 + static_cast<size_t>(ranks) + static_cast<size_t>(p);
  }
  MC_HD static constexpr size_t put(int ranks, int p) {
    return 2 + 2 * static_cast<size_t>(ranks) + static_cast<size_t>(p);
  }
};
// Rounds a pair may take (the round fits 16 bits of its word, whose top value
// is a sender's word to a receiver it stopped serving: kVaryStopped).
constexpr uint64_t kVaryMaxRounds = 0xffff;
constexpr uint64_t kVaryStopped = 0xffff;
MC_HD inline uint64_t vary_word(uint32_t gen, uint64_t seq, uint64_t round) {
  return (static_cast<uint64_t>(gen & 0xffffu) << 48) | ((seq & 0xffffffffu) << 16) |
         (round & 0xffffu);
}
// Whether `word` says round `round` of op `seq` (generation `gen`) or later:
// `later_op` also takes any later op of the generation (a receiver that went
// on read everything of this one; a sender that did is not sending it).
MC_HD inline bool vary_reached(uint64_t word, uint32_t gen, uint64_t seq, uint64_t round,
                               bool later_op) {
  if ((word >> 48) != (gen & 0xffffu)) return false;
  const auto s = static_cast<uint32_t>(word >> 16);
  const uint32_t ahead = s - static_cast<uint32_t>(seq);
  if (ahead == 0) return (word & 0xffffu) >= round;
  return later_op && ahead < 0x80000000u;
}

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
  // A mapped all_reduce's (block 0 writes, the grid reads): each member's tensor
  // as this process maps it, whether every one of them is mapped here, and
  // how the launch goes on: 1 every share in place, 2 through the segments,
  // 0 writing nothing (DirectOutcome::mapped).
  const uint8_t* mapped[kDirectMaxRanks];
  int32_t mapped_here;
  int32_t mapped_all;
  // An all_to_all with per-pair sizes (block 0 writes, the grid reads): 1
  // where a pair of members disagreed on its sizes (nothing moves); per rank,
  // 1 where this rank stopped receiving from it (its put did not come) or
  // sending to it (its read did not).
  int32_t vary_void;
  int32_t vary_in_cut[kDirectMaxRanks];
  int32_t vary_out_cut[kDirectMaxRanks];
};

// What a watched launch found (host-mapped; DirectOutcomes leases one per
// launch): block 0 writes the bits, fences, then the ticket the host gave the
// launch, so the host that waited for the launch knows the words are this
// launch's. Bit j stands for rank j (kDirectMaxRanks is 64).
struct DirectOutcome {
  uint64_t took;        // ranks whose input the op took in (this rank too)
  uint64_t rejected;    // peers that rejected their arguments
  uint64_t mismatched;  // peers that called another op, or another root, count, dtype or op
  uint64_t stale;       // peers that had gone on without this rank
  // Peers whose signal of this op came (whatever their call), also where this
  // rank rejected its own: who was there, for the host's view of the members.
  uint64_t present;
  // A mapped all_reduce: 1 it read the tensors in place; 2 it went through the
  // segments (a member could not map another's tensor, or was lost before its
  // share was reduced); 0 it wrote nothing (this rank was left out).
  uint64_t mapped;
  // An all_to_all with per-pair sizes: the first pair of members (a bit
  // each) whose sizes disagreed (what one sends, the other expects): the op
  // moved nothing at any member.
  uint64_t sizes;
  uint64_t ticket;  // written last
};
static_assert(kDirectMaxRanks <= 64, "DirectOutcome holds a bit per rank");

// Which side of an op its caller gave as one buffer per part (DirectArgs::parts):
// the torch backend's tensor lists, each at its own address.
enum class DirectList : uint8_t {
  kNone = 0,
  kIn = 1,   // the input's parts (scatter's at the root, reduce_scatter's)
  kOut = 2,  // the output's parts (all_gather's, gather's at the root, all_to_all's)
};

struct DirectArgs {
  DirectKind kind;
  int root;  // of a rooted kind (0 otherwise)
  // The wait helpers' view of this launch: peers = state->areas, active_ranks
  // = state->live, the host's lost words, the silent and status words, the
  // per-phase budget and the grid barrier's words.
  Common c;
  DirectState* state;
  DirectLayout layout;
  // This rank's input and output (direct_in_parts / direct_out_parts parts;
  // null where there are none or count is 0). all_reduce's may be the same;
  // the others' may overlap (inputs are read from the areas).
  const void* in;
  void* out;
  size_t count;  // elements of one part (DirectKind)
  // Elements from one part's first to the next's, in `in` and `out` where
  // they hold several (count: the parts back to back). An op in pieces (one
  // launch per piece of every part) passes the whole op's part size.
  size_t stride;
  size_t esize;  // bytes of an element of `dtype`
  DType dtype;
  RedOp op;
  // direct_shape(kind, root, count, dtype, op, two_shot); kShapeRejected: this rank
  // rejected its arguments and takes part without data (in and out unused).
  uint64_t shape;
  bool two_shot;  // all_reduce only
  // in and out are 16-byte aligned, and so are a part's size and the stride
  // where an input or output holds several
  bool vec;
  // Where block 0 leaves what it decided (device view of host memory; null:
  // nowhere), and the ticket it writes last.
  DirectOutcome* outcome;
  uint64_t ticket;
  // With `list`, that side's part p is at parts[p] (its `in` or `out` unused),
  // `count` elements each; `vec` then holds for every part.
  DirectList list;
  void* parts[kDirectMaxRanks];
  // all_reduce in place (in == out), read where each member's tensor lies
  // (below): this rank's offer of `out` (its export's generation, 0: none,
  // slot and byte offset), this process's mappings of the members' exports
  // ([ranks][kXSlots]) and where a launch leaves the exports it lacks
  // (host-mapped [ranks][2], x_miss; the host maps them for the next op).
  bool mapped;
  uint32_t offer_gen, offer_slot;
  int64_t offer_off;
  const XImport* imports;
  uint64_t* misses;
  // Bytes from a rank's segment to its area, the host-driven plane's part
  // (each rank's segment is its area less this): a mapped op served through
  // the segments copies a piece of at most this many bytes there.
  size_t plane_bytes;
  // all_to_all with per-pair sizes (VaryTable): part p of the input is
  // send_bytes[p] bytes at in_parts[p], for rank p; part p of the output
  // (parts[p], `list` kOut) expects recv_bytes[p] from rank p (`count` 0;
  // `vec` unused: each copy goes by vectors where its two ends are aligned).
  bool vary;
  const void* in_parts[kDirectMaxRanks];
  uint64_t send_bytes[kDirectMaxRanks];
  uint64_t recv_bytes[kDirectMaxRanks];
};

// Queues one launch of `blocks` blocks on `stream`; returns its cudaError_t.
int launch_direct(const DirectArgs& args, int blocks, CUstream_st* stream);

}  // namespace mooncake::kernels
