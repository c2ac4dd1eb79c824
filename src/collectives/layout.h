// The layout of one group's segment, as a struct with named offsets (not
// pointer arithmetic). Every rank computes the same layout from (capacity, chunk bytes).
//
//   [header: doorbells]
//   [flags: for each plane and peer p, a ready flag (messages p has posted to
//    us) and an ack flag (our messages p has consumed), 64 bytes apart]
//   [slots: for each region r, plane, peer p and slot s, a 64-byte MsgHeader + chunk]
//
// Fencing: a sender writes into the region of its own incarnation's parity,
// and a receiver reads the region of the sender's current incarnation. A
// process that was left out while stopped and then resumes may still finish
// the piece it was writing when it stopped (its mapping of our segment cannot
// be taken back); that piece lands in the region of its own incarnation,
// which the replacement in its slot (the next incarnation) never uses. Only a
// process stopped across two replacements of its slot could reach a region in
// use again. The flags need no regions: their values carry a generation.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "transport/segment.h"

namespace mooncake {

enum class Plane : int { kCollective = 0, kP2P = 1 };
constexpr int kNumPlanes = 2;
static_assert(2 * kNumPlanes <= kNumBells, "a data bell and an ack bell per plane");
constexpr int kSlotsPerChannel =
    2;  // double buffering: a peer fills one slot while we read the other
constexpr size_t kFlagStride = 64;  // one cache line per flag: writers never share a line
constexpr int kSlotRegions = 2;     // by the sender's incarnation parity (see Fencing above)

// The slot region of a sender's incarnation.
inline int slot_region(uint32_t incarnation) {
  return static_cast<int>(incarnation % kSlotRegions);
}

constexpr uint16_t kMsgRejected = 1;  // the sender rejected its own arguments for this op

// The header in front of every message.
struct MsgHeader {
  uint64_t op_seq;   // collective: the op's sequence number; p2p: tag
  uint32_t op_type;  // collective op; p2p: 1 on a message's first chunk
  uint8_t dtype;
  uint8_t redop;
  uint16_t flags;  // kMsg* bits
  int32_t root;
  uint32_t len;          // payload bytes in this message
  uint64_t numel;        // collective: size the op was called with; p2p: total message bytes
  uint64_t edge_bytes;   // collective: bytes the sender sends us in this op
  uint64_t edge_expect;  // collective: bytes the sender expects from us in this op
                         // (in a round of verdicts: the sender's step count)
  uint64_t reserved1[2];
};
static_assert(sizeof(MsgHeader) == 64);

// A message of `bytes` bytes travels in pieces of at most `chunk` bytes; an
// empty one still takes one piece (it carries the header).
inline size_t num_pieces(size_t bytes, size_t chunk) {
  return bytes == 0 ? 1 : (bytes + chunk - 1) / chunk;
}
// The length of piece `k` (0 past the end).
inline size_t piece_bytes(size_t bytes, size_t chunk, size_t k) {
  const size_t begin = k * chunk;
  return begin >= bytes ? 0 : std::min(chunk, bytes - begin);
}

struct Layout {
  int capacity = 0;        // ranks the segment has room for
  size_t chunk_bytes = 0;  // payload bytes of one slot

  size_t flags_begin() const { return kSegmentHeaderBytes; }
  size_t ready_flag(Plane plane, int peer) const {
    return flags_begin() + ((static_cast<size_t>(plane) * capacity + peer) * 2) * kFlagStride;
  }
  size_t ack_flag(Plane plane, int peer) const { return ready_flag(plane, peer) + kFlagStride; }
  size_t slots_begin() const {
    return flags_begin() + static_cast<size_t>(kNumPlanes) * capacity * 2 * kFlagStride;
  }
  size_t slot_bytes() const { return sizeof(MsgHeader) + chunk_bytes; }
  // Where messages from `src` on `plane` land, slot `slot`, in region `region`
  // (slot_region of the sender's incarnation).
  size_t slot(Plane plane, int src, int slot_index, int region) const {
    const size_t channel =
        (static_cast<size_t>(region) * kNumPlanes + static_cast<size_t>(plane)) * capacity + src;
    return slots_begin() + (channel * kSlotsPerChannel + slot_index) * slot_bytes();
  }
  size_t total_bytes() const {
    return slots_begin() + static_cast<size_t>(kSlotRegions) * kNumPlanes * capacity *
                               kSlotsPerChannel * slot_bytes();
  }
};

}  // namespace mooncake
