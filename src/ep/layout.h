// The EP workspace: what every rank reserves for low-latency dispatch and
// combine, as one struct with named offsets. The size hint that
// Buffer.get_ep_buffer_size_hint returns is EpLayout(shape).total_bytes, and
// the device path places its signals and messages at these offsets.
//
// Shapes: T = max tokens a rank dispatches per call, H = hidden size,
// R = ranks, E = experts (E % R == 0; each rank holds E/R local experts).
//
// The workspace is two halves (even and odd calls), so that one call's
// combine can still read its half while the next dispatch fills the other:
//
//   half = | signals | send | recv |        total = 2 * half
//
//   signals  2E int32, 128-byte aligned: E dispatch counts (one per local
//            expert and source rank, E/R * R = E) and E combine flags (one
//            per global expert a token may hear back from);
//   send     max(T dispatch messages, E*T combine messages): dispatch packs
//            each token once; combine sends every row it received back;
//   recv     E*T dispatch messages: [E/R local experts][R sources][T tokens],
//            the most any call can deliver (every token of every source to
//            every local expert); combine's E*T returning messages fit too.
//
// Messages:
//   dispatch  16-byte header (source token index, local expert, reserved) +
//             payload: 2H bytes of BF16, or with FP8 H bytes of e4m3 plus
//             ceil(H/128) fp32 scales (one per 128 channels); the slot is
//             sized for the larger of the two, so one layout serves both;
//   combine   2H bytes of BF16, no header: rows go back in the order they
//             came, so the sender knows which (token, expert) each one is.
//
// Every region starts on a 128-byte boundary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake {

struct EpShape {
  int64_t max_tokens = 0;   // T: num_max_dispatch_tokens_per_rank
  int64_t hidden = 0;       // H
  int64_t num_ranks = 0;    // R
  int64_t num_experts = 0;  // E
};

struct EpLayout {
  static constexpr size_t kAlign = 128;
  static constexpr size_t kHeaderBytes = 16;
  static constexpr int64_t kFp8Block = 128;  // channels per FP8 scale

  struct Region {
    size_t offset = 0;  // from the start of the workspace
    size_t bytes = 0;
  };
  struct Half {
    Region signals, send, recv;
  };

  // Throws an invalid-argument Error naming the field and its rule.
  explicit EpLayout(const EpShape& shape);

  EpShape shape;
  int64_t local_experts = 0;      // E / R
  size_t bf16_payload_bytes = 0;  // 2H
  size_t fp8_payload_bytes = 0;   // H + 4 * ceil(H / 128)
  size_t dispatch_msg_bytes = 0;  // header + the larger payload, aligned to 16
  size_t combine_msg_bytes = 0;   // 2H
  Half halves[2];
  size_t half_bytes = 0;
  size_t total_bytes = 0;  // the size hint
};

}  // namespace mooncake
