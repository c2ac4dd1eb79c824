// The EP workspace: what every rank reserves for low-latency dispatch and
// combine, as one struct with named offsets. The size hint that
// Buffer.get_ep_buffer_size_hint returns is EpLayout(shape).total_bytes; the
// device kernels (src/kernels) place their signals and rows with the
// accessors below, which compile for host and device alike.
//
// Shapes: T = max tokens a rank dispatches per call, H = hidden size,
// R = ranks, E = experts (E % R == 0; each rank holds E/R local experts).
//
// The workspace is two halves (even and odd calls, by the call's sequence
// number), so that one call's combine can still read its half while the next
// dispatch fills the other:
//
//   | signals 0 | signals 1 | headers 0 | rows 0 | stage 0 | index 0 | headers 1 | ... |
//
// (half = signals + headers + rows + stage + index; total = 2 * half). The
// signals of both halves come first, so their places depend on E and R alone:
// a call of another T or H never takes data an earlier call left for a signal.
//
//   signals   2E int64, 128-byte aligned: E dispatch counts, one per (local
//             expert, source rank) ([E/R][R]), each `tag << 32 | count`; and
//             E combine flags, one per global expert a token may hear back
//             from, each `tag << 32 | first row` (the row of the expert
//             owner's rows region where its outputs for this rank start, or
//             kNoRows). The tag (tag_of) is the call's sequence number with
//             the writer's fence key, so a late write from a dead or masked
//             peer, from an earlier call, or from a process its slot has since
//             been given to another (a resumed or late kernel of a rank left
//             out), never reads as this call's. A
//             count's place depends on R, which an elastic buffer's calls
//             choose, so ranks store only into the workspaces of ranks they
//             count in: a peer's call of another R reads its places elsewhere;
//   headers   E*T EpMsgHeaders, [E/R local experts][R sources][T slots]: the
//             most any call can deliver (every token of every source to
//             every local expert); a source writes the headers of its rows for
//             local expert j, in token order, into its own T slots, each with
//             its tag: a receiver takes only headers of the tag it expects;
//   rows      E*T rows of `row_bytes`: the expert outputs a combine returns,
//             where the token owners read them. A zero-copy combine finds them
//             in recv_x's layout, [E/R local experts][R*T] (the zero-copy
//             combine buffer is this region, as a [E/R, R*T, H] tensor);
//             otherwise the combine copies them in packed by token owner,
//             [R sources][E/R * T], so that each owner's rows lie together.
//             A path that cannot read its peers' memory would receive
//             dispatch payloads here;
//   stage     T rows of `row_bytes`: this rank's tokens as the receivers copy
//             them (quantised to FP8 once, or as they are); a BF16/FP16 call
//             at world 1 in one launch skips it;
//   index     T * kMaxTopk int64, [T tokens][top-k slot]: which slot each of
//             this rank's selections took at its expert (`tag << 32 | slot`),
//             so that a combine finds the expert's output row (the expert's
//             first row for this rank, from the flag, plus the slot). Only
//             this rank writes or reads it.
//
// Ranks read each other's mapped workspaces (CUDA IPC), so no send region is
// reserved; a transport that must stage would add one.
//
// Rows: 2H bytes of BF16/FP16, or with FP8 H bytes of e4m3 plus ceil(H/128)
// fp32 scales (one per 128 channels); `row_bytes` is the larger, 16-byte
// aligned (2H whenever H % 8 == 0, so the rows region is a plain tensor).
//
// Every region starts on a 128-byte boundary.
//
// Fencing (device/ep.h says who sets what): every process's fence key is
// that of its incarnation in its slot (an elastic buffer's), or the
// generation of the group's EP membership it joined (a process group's), and
// each receiver knows the key of the process it maps in every slot. Tags are
// 8 bits of key (1 + key mod 255 on the device: never 0, so no tag is a
// cleared word) and 24 of sequence number: a stale writer's tag matches only
// after 255 changes of key in its slot while it still runs, or 2^24 calls.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/hd.h"

namespace mooncake {

struct EpShape {
  int64_t max_tokens = 0;   // T: num_max_dispatch_tokens_per_rank
  int64_t hidden = 0;       // H
  int64_t num_ranks = 0;    // R
  int64_t num_experts = 0;  // E
};

// The header of one dispatch message (the portable path sends the same one).
struct EpMsgHeader {
  int32_t token;         // the source's token index
  int32_t local_expert;  // at the receiver, in [0, E/R)
  int32_t topk_slot;     // the column of topk_idx that selected it
  uint32_t tag;          // EpLayout::tag_of the call and the writer (the portable path: 0)
};
static_assert(sizeof(EpMsgHeader) == 16, "the header is 16 bytes on the wire");

struct EpLayout {
  static constexpr size_t kAlign = 128;
  static constexpr size_t kHeaderBytes = sizeof(EpMsgHeader);
  static constexpr int64_t kFp8Block = 128;  // channels per FP8 scale
  static constexpr int64_t kMaxTopk = 16;    // top-k columns: index entries per token
  // A combine flag's low word when the expert got none of this rank's rows.
  static constexpr uint32_t kNoRows = 0xffffffffu;
  static constexpr int kTagSeqBits = 24;  // the rest of a tag's 32 bits: the fence key's

  // The tag of call `seq` by the process of fence key `key` (see Fencing above).
  static MC_HD uint32_t tag_of(uint64_t seq, uint32_t key) {
    return (key << kTagSeqBits) | static_cast<uint32_t>(seq & ((1u << kTagSeqBits) - 1));
  }

  struct Region {
    size_t offset = 0;  // from the start of the workspace
    size_t bytes = 0;
  };
  struct Half {
    Region signals, headers, rows, stage, index;
  };

  EpLayout() = default;
  // Throws an invalid-argument Error naming the field and its rule.
  explicit EpLayout(const EpShape& shape);

  EpShape shape;
  int64_t local_experts = 0;      // E / R
  size_t bf16_payload_bytes = 0;  // 2H
  size_t fp8_payload_bytes = 0;   // H + 4 * ceil(H / 128)
  size_t row_bytes = 0;           // the larger payload, aligned to 16
  Half halves[2];
  size_t half_bytes = 0;
  size_t total_bytes = 0;  // the size hint

  // Offsets (bytes from the workspace's start) of one call's places; `seq` is
  // the call's sequence number and picks the half.
  MC_HD size_t dispatch_count(uint64_t seq, int64_t local_expert, int64_t source) const {
    return halves[seq & 1].signals.offset +
           8 * static_cast<size_t>(local_expert * shape.num_ranks + source);
  }
  MC_HD size_t combine_flag(uint64_t seq, int64_t global_expert) const {
    return halves[seq & 1].signals.offset + 8 * static_cast<size_t>(shape.num_experts) +
           8 * static_cast<size_t>(global_expert);
  }
  MC_HD size_t header(uint64_t seq, int64_t local_expert, int64_t source, int64_t slot) const {
    const auto index = (local_expert * shape.num_ranks + source) * shape.max_tokens + slot;
    return halves[seq & 1].headers.offset + static_cast<size_t>(index) * kHeaderBytes;
  }
  // Row `row` of the rows region (E*T rows).
  MC_HD size_t expert_row(uint64_t seq, int64_t row) const {
    return halves[seq & 1].rows.offset + static_cast<size_t>(row) * row_bytes;
  }
  MC_HD size_t stage_row(uint64_t seq, int64_t token) const {
    return halves[seq & 1].stage.offset + static_cast<size_t>(token) * row_bytes;
  }
  MC_HD size_t combine_index(uint64_t seq, int64_t token, int64_t topk_slot) const {
    return halves[seq & 1].index.offset + 8 * static_cast<size_t>(token * kMaxTopk + topk_slot);
  }
};

}  // namespace mooncake
