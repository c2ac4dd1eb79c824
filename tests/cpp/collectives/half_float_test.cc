// The library's float16/bfloat16 conversions agree bit for bit with the
// independent reference: every 16-bit pattern decodes exactly, and encoding
// rounds to nearest even, overflows to infinity and keeps NaN a NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "collectives/reduce.h"
#include "collectives/reference.h"

namespace mctest {
namespace {

struct Codec {
  const char* name;
  float (*lib_decode)(uint16_t);
  uint16_t (*lib_encode)(float);
  float (*ref_decode)(uint16_t);
  uint16_t (*ref_encode)(float);
  uint16_t exp_mask;
};

const Codec kCodecs[] = {
    {"float16", mooncake::half_to_float, mooncake::float_to_half, ref_half_to_float,
     ref_float_to_half, 0x7c00},
    {"bfloat16", mooncake::bf16_to_float, mooncake::float_to_bf16, ref_bf16_to_float,
     ref_float_to_bf16, 0x7f80},
};

bool is_nan_pattern(const Codec& c, uint16_t bits) {
  return (bits & c.exp_mask) == c.exp_mask && (bits & ~c.exp_mask & 0x7fff) != 0;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Checks the library's encoding of `f` against the reference.
void expect_encodes_like_reference(const Codec& c, float f) {
  const uint16_t got = c.lib_encode(f), want = c.ref_encode(f);
  if (std::isnan(f)) {
    ASSERT_TRUE(is_nan_pattern(c, got))
        << c.name << ": NaN 0x" << std::hex << bits_of(f) << " encoded as 0x" << got;
    return;
  }
  ASSERT_EQ(got, want) << c.name << ": encoding " << f << " (0x" << std::hex << bits_of(f) << ")";
}

TEST(HalfFloat, EveryPatternDecodesExactly) {
  for (const Codec& c : kCodecs) {
    for (uint32_t b = 0; b <= 0xffff; ++b) {
      const uint16_t bits = static_cast<uint16_t>(b);
      const float got = c.lib_decode(bits), want = c.ref_decode(bits);
      if (is_nan_pattern(c, bits)) {
        ASSERT_TRUE(std::isnan(got)) << c.name << " 0x" << std::hex << b;
        continue;
      }
      ASSERT_EQ(bits_of(got), bits_of(want)) << c.name << " 0x" << std::hex << b;
    }
  }
}

TEST(HalfFloat, EveryRepresentableValueAndEveryMidpointEncodesLikeTheReference) {
  for (const Codec& c : kCodecs) {
    for (uint32_t b = 0; b < 0xffff; ++b) {
      const uint16_t bits = static_cast<uint16_t>(b);
      if (is_nan_pattern(c, bits) || is_nan_pattern(c, bits + 1)) continue;
      const float v = c.ref_decode(bits);
      expect_encodes_like_reference(c, v);
      if ((bits & 0x7fff) == 0x7fff || (bits & 0x7fff) == c.exp_mask) continue;  // no next value
      const double next = c.ref_decode(static_cast<uint16_t>(bits + 1));
      const float mid = static_cast<float>((static_cast<double>(v) + next) / 2);  // a tie
      expect_encodes_like_reference(c, mid);
      expect_encodes_like_reference(c, std::nextafter(mid, 0.0f));
      expect_encodes_like_reference(c, std::nextafter(mid, std::numeric_limits<float>::infinity()));
    }
  }
}

TEST(HalfFloat, RandomFloatsEncodeLikeTheReference) {
  uint32_t x = 12345;
  for (int i = 0; i < 200000; ++i) {
    x = x * 1664525u + 1013904223u;
    for (const Codec& c : kCodecs) expect_encodes_like_reference(c, float_of(x));
  }
}

TEST(HalfFloat, TiesRoundToEvenAndOverflowGoesToInfinity) {
  EXPECT_EQ(mooncake::float_to_half(1.0f + 1.0f / 2048), 0x3c00);  // tie, down to even
  EXPECT_EQ(mooncake::float_to_half(1.0f + 3.0f / 2048), 0x3c02);  // tie, up to even
  EXPECT_EQ(mooncake::float_to_half(65520.0f), 0x7c00);            // rounds past max
  EXPECT_EQ(mooncake::float_to_bf16(1.0f + 1.0f / 256), 0x3f80);   // tie, down to even
  EXPECT_EQ(mooncake::float_to_bf16(1.0f + 3.0f / 256), 0x3f82);   // tie, up to even
  EXPECT_EQ(mooncake::float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(HalfFloat, NaNsStayNaNsEvenWithOnlyLowMantissaBits) {
  for (uint32_t nan : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7f80ffffu}) {
    EXPECT_TRUE(is_nan_pattern(kCodecs[0], mooncake::float_to_half(float_of(nan))))
        << std::hex << nan;
    EXPECT_TRUE(is_nan_pattern(kCodecs[1], mooncake::float_to_bf16(float_of(nan))))
        << std::hex << nan;
  }
}

}  // namespace
}  // namespace mctest
