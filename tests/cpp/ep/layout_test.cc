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
  const size_t row = up(std::max(2 * H, H + 4 * ((H + 127) / 128)), 16);
  const size_t signals = up(2 * E * 8, 128);
  const size_t headers = up(E * T * 16, 128);
  const size_t rows = up(E * T * row, 128);
  const size_t stage = up(T * row, 128);
  const size_t index = up(T * 16 * 8, 128);
  return 2 * (signals + headers + rows + stage + index);
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
  // T=128, H=7168, R=8, E=288: a row is 14336 bytes (BF16), a header 16.
  const EpLayout l(EpShape{128, 7168, 8, 288});
  EXPECT_EQ(l.row_bytes, 14336u);
  EXPECT_EQ(l.fp8_payload_bytes, 7168u + 4u * 56u);
  EXPECT_EQ(l.total_bytes, 2u * (4608u + 589824u + 528482304u + 1835008u + 16384u));
}

TEST(EpLayout, RegionsAreAlignedAndDisjointAndFillTheWorkspace) {
  const EpLayout l(EpShape{37, 896, 4, 12});
  const auto& h = l.halves;
  size_t at = 0;
  for (const EpLayout::Region* r :
       {&h[0].signals, &h[1].signals, &h[0].headers, &h[0].rows, &h[0].stage, &h[0].index,
        &h[1].headers, &h[1].rows, &h[1].stage, &h[1].index}) {
    EXPECT_EQ(r->offset, at);
    EXPECT_EQ(r->offset % EpLayout::kAlign, 0u);
    EXPECT_EQ(r->bytes % EpLayout::kAlign, 0u);
    at += r->bytes;
  }
  EXPECT_EQ(at, l.total_bytes);
  EXPECT_EQ(2 * l.half_bytes, l.total_bytes);
}

// Signals sit where E and R put them, whatever T and H are.
TEST(EpLayout, SignalsDependOnExpertsAndRanksOnly) {
  const EpLayout a(EpShape{128, 7168, 4, 32}), b(EpShape{3, 128, 4, 32});
  for (uint64_t seq : {1u, 2u}) {
    EXPECT_EQ(a.dispatch_count(seq, 7, 3), b.dispatch_count(seq, 7, 3));
    EXPECT_EQ(a.combine_flag(seq, 31), b.combine_flag(seq, 31));
  }
}

TEST(EpLayout, EveryMessageFitsItsRegion) {
  const int64_t T = 5, H = 384, R = 2, E = 6;
  const EpLayout l(EpShape{T, H, R, E});
  const auto& h = l.halves[0];
  EXPECT_GE(h.signals.bytes, 2u * E * 8);
  EXPECT_GE(h.headers.bytes, (E / R) * R * T * EpLayout::kHeaderBytes);
  EXPECT_GE(h.rows.bytes, (E / R) * R * T * l.row_bytes);
  EXPECT_GE(l.row_bytes, l.fp8_payload_bytes);
  EXPECT_GE(l.row_bytes, l.bf16_payload_bytes);
  // With H % 8 == 0 a row is exactly 2H bytes: the rows region is a plain
  // [E/R, R*T, H] tensor (the zero-copy combine buffer).
  for (int64_t h8 : {8, 128, 7168}) EXPECT_EQ(EpLayout(EpShape{T, h8, R, E}).row_bytes, 2u * h8);
}

// The accessors the kernels use: every place of every call lands inside its
// half's region, one place after another with no gap or overlap.
TEST(EpLayout, AccessorsStayInsideTheirRegions) {
  const int64_t T = 3, H = 256, R = 2, E = 4;
  const EpLayout l(EpShape{T, H, R, E});
  for (uint64_t seq : {1u, 2u}) {
    const auto& h = l.halves[seq & 1];
    auto inside = [](const EpLayout::Region& r, size_t at, size_t n) {
      return at >= r.offset && at + n <= r.offset + r.bytes;
    };
    size_t next = h.signals.offset;
    for (int64_t j = 0; j < E / R; ++j)
      for (int64_t s = 0; s < R; ++s) {
        EXPECT_EQ(l.dispatch_count(seq, j, s), next);
        next += 8;
      }
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_EQ(l.combine_flag(seq, e), next);
      next += 8;
    }
    EXPECT_TRUE(inside(h.signals, h.signals.offset, next - h.signals.offset));
    next = h.headers.offset;
    for (int64_t j = 0; j < E / R; ++j)
      for (int64_t s = 0; s < R; ++s)
        for (int64_t t = 0; t < T; ++t) {
          EXPECT_EQ(l.header(seq, j, s, t), next);
          EXPECT_TRUE(inside(h.headers, next, EpLayout::kHeaderBytes));
          next += EpLayout::kHeaderBytes;
        }
    next = h.rows.offset;
    for (int64_t row = 0; row < E * T; ++row) {
      EXPECT_EQ(l.expert_row(seq, row), next);
      EXPECT_TRUE(inside(h.rows, next, l.row_bytes));
      next += l.row_bytes;
    }
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(l.stage_row(seq, t), h.stage.offset + t * l.row_bytes);
      EXPECT_TRUE(inside(h.stage, l.stage_row(seq, t), l.row_bytes));
    }
    next = h.index.offset;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < EpLayout::kMaxTopk; ++k) {
        EXPECT_EQ(l.combine_index(seq, t, k), next);
        EXPECT_TRUE(inside(h.index, next, 8));
        next += 8;
      }
  }
}

// A tag is the call's number and the writer's fence key: tags of two keys
// never meet, whatever the calls; nor do two calls' of one key, within 2^24.
TEST(EpLayout, TagsTellKeysAndCallsApart) {
  for (uint32_t key : {0u, 1u, 7u, 255u})
    for (uint64_t seq : {uint64_t{1}, uint64_t{2}, uint64_t{1} << 23, (uint64_t{1} << 24) - 1}) {
      const uint32_t tag = EpLayout::tag_of(seq, key);
      EXPECT_EQ(tag >> EpLayout::kTagSeqBits, key);
      EXPECT_NE(tag, EpLayout::tag_of(seq, key + 1)) << seq << " " << key;
      EXPECT_NE(tag, EpLayout::tag_of(seq + 1, key)) << seq << " " << key;
      EXPECT_NE(tag, EpLayout::tag_of(seq + 1, key ^ 1)) << seq << " " << key;
    }
  EXPECT_EQ(EpLayout::tag_of(1, 256), EpLayout::tag_of(1, 0));  // keys are 8 bits
  EXPECT_EQ(EpLayout::tag_of(uint64_t{1} << 24, 3), EpLayout::tag_of(0, 3));
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
