// The EP workspace layout: the size hint's closed formula, regions that do
// not overlap, and shapes that are refused with the rule they break.
#include "ep/layout.h"

#include <gtest/gtest.h>

#include "errors.h"

namespace mctest {
namespace {

using mooncake::EpLayout;
using mooncake::EpShape;
using mooncake::ErrorKind;

size_t up(size_t n, size_t a) {
  return (n + a - 1) / a * a;
}

// The formula as the header states it, written out independently.
size_t formula(size_t T, size_t H, size_t E) {
  const size_t msg = up(16 + std::max(2 * H, H + 4 * ((H + 127) / 128)), 16);
  const size_t signals = up(2 * E * 4, 128);
  const size_t send = up(std::max(T * msg, E * T * 2 * H), 128);
  const size_t recv = up(E * T * msg, 128);
  return 2 * (signals + send + recv);
}

TEST(EpLayout, SizeHintIsTheClosedFormula) {
  for (int64_t T : {1, 7, 128, 256})
    for (int64_t H : {128, 2048, 7168, 100})
      for (auto [R, E] : {std::pair<int64_t, int64_t>{1, 1}, {2, 8}, {8, 288}, {16, 256}}) {
        const EpLayout l(EpShape{T, H, R, E});
        EXPECT_EQ(l.total_bytes, formula(T, H, E)) << T << " " << H << " " << R << " " << E;
        EXPECT_EQ(l.local_experts, E / R);
      }
}

TEST(EpLayout, KnownValueForADeepSeekShape) {
  // T=128, H=7168, R=8, E=288: a dispatch message is 16 + 14336 bytes.
  const EpLayout l(EpShape{128, 7168, 8, 288});
  EXPECT_EQ(l.dispatch_msg_bytes, 14352u);
  EXPECT_EQ(l.combine_msg_bytes, 14336u);
  EXPECT_EQ(l.fp8_payload_bytes, 7168u + 4u * 56u);
  EXPECT_EQ(l.total_bytes, 2u * (2304u + 528482304u + 529072128u));
}

TEST(EpLayout, RegionsAreAlignedAndDisjointAndFillTheWorkspace) {
  const EpLayout l(EpShape{37, 896, 4, 12});
  size_t at = 0;
  for (const auto& h : l.halves)
    for (const EpLayout::Region* r : {&h.signals, &h.send, &h.recv}) {
      EXPECT_EQ(r->offset, at);
      EXPECT_EQ(r->offset % EpLayout::kAlign, 0u);
      EXPECT_EQ(r->bytes % EpLayout::kAlign, 0u);
      at += r->bytes;
    }
  EXPECT_EQ(at, l.total_bytes);
  EXPECT_EQ(l.halves[1].signals.offset, l.half_bytes);
}

TEST(EpLayout, EveryMessageFitsItsRegion) {
  const int64_t T = 5, H = 384, R = 2, E = 6;
  const EpLayout l(EpShape{T, H, R, E});
  const auto& h = l.halves[0];
  EXPECT_GE(h.signals.bytes, 2u * E * 4);
  EXPECT_GE(h.send.bytes, T * l.dispatch_msg_bytes);     // dispatch: each token once
  EXPECT_GE(h.send.bytes, E * T * l.combine_msg_bytes);  // combine: every received row
  EXPECT_GE(h.recv.bytes, (E / R) * R * T * l.dispatch_msg_bytes);
  EXPECT_GE(l.dispatch_msg_bytes, EpLayout::kHeaderBytes + l.fp8_payload_bytes);
  EXPECT_GE(l.dispatch_msg_bytes, EpLayout::kHeaderBytes + l.bf16_payload_bytes);
}

TEST(EpLayout, BadShapesNameTheArgument) {
  auto bad = [](EpShape s, const char* contains) {
    return throws_error(ErrorKind::kInvalidArgument, [&] { EpLayout l(s); }, contains);
  };
  EXPECT_TRUE(bad({0, 128, 2, 8}, "num_max_dispatch_tokens_per_rank must be >= 1"));
  EXPECT_TRUE(bad({4, 0, 2, 8}, "hidden must be >= 1"));
  EXPECT_TRUE(bad({4, 128, 0, 8}, "num_ranks must be >= 1"));
  EXPECT_TRUE(bad({4, 128, 2, 0}, "num_experts must be >= 1"));
  EXPECT_TRUE(bad({4, 128, 3, 8}, "num_experts (8) must be divisible by num_ranks (3)"));
  EXPECT_TRUE(bad({int64_t{1} << 30, 1 << 20, 1024, 1 << 20}, "too large"));
}

}  // namespace
}  // namespace mctest
