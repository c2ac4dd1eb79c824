// SipHash-2-4 against the reference vectors of Aumasson and Bernstein
// (key 00..0f, message 00..n-1 for n = 0..63: the table in the reference
// implementation's vectors.h; the paper's appendix gives the 15-byte one),
// and the properties the shm seal relies on: another key or another message
// gives another hash, and any length and alignment of the input works.
#include "core/siphash.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

namespace mctest {
namespace {

using mooncake::siphash24;

// SipHash-2-4 of bytes 00..n-1 under key 00..0f, for n = 0..63.
constexpr uint64_t kReference[64] = {
    0x726fdb47dd0e0e31ull, 0x74f839c593dc67fdull, 0x0d6c8009d9a94f5aull, 0x85676696d7fb7e2dull,
    0xcf2794e0277187b7ull, 0x18765564cd99a68dull, 0xcbc9466e58fee3ceull, 0xab0200f58b01d137ull,
    0x93f5f5799a932462ull, 0x9e0082df0ba9e4b0ull, 0x7a5dbbc594ddb9f3ull, 0xf4b32f46226bada7ull,
    0x751e8fbc860ee5fbull, 0x14ea5627c0843d90ull, 0xf723ca908e7af2eeull, 0xa129ca6149be45e5ull,
    0x3f2acc7f57c29bdbull, 0x699ae9f52cbe4794ull, 0x4bc1b3f0968dd39cull, 0xbb6dc91da77961bdull,
    0xbed65cf21aa2ee98ull, 0xd0f2cbb02e3b67c7ull, 0x93536795e3a33e88ull, 0xa80c038ccd5ccec8ull,
    0xb8ad50c6f649af94ull, 0xbce192de8a85b8eaull, 0x17d835b85bbb15f3ull, 0x2f2e6163076bcfadull,
    0xde4daaaca71dc9a5ull, 0xa6a2506687956571ull, 0xad87a3535c49ef28ull, 0x32d892fad841c342ull,
    0x7127512f72f27cceull, 0xa7f32346f95978e3ull, 0x12e0b01abb051238ull, 0x15e034d40fa197aeull,
    0x314dffbe0815a3b4ull, 0x027990f029623981ull, 0xcadcd4e59ef40c4dull, 0x9abfd8766a33735cull,
    0x0e3ea96b5304a7d0ull, 0xad0c42d6fc585992ull, 0x187306c89bc215a9ull, 0xd4a60abcf3792b95ull,
    0xf935451de4f21df2ull, 0xa9538f0419755787ull, 0xdb9acddff56ca510ull, 0xd06c98cd5c0975ebull,
    0xe612a3cb9ecba951ull, 0xc766e62cfcadaf96ull, 0xee64435a9752fe72ull, 0xa192d576b245165aull,
    0x0a8787bf8ecb74b2ull, 0x81b3e73d20b49b6full, 0x7fa8220ba3b2eceaull, 0x245731c13ca42499ull,
    0xb78dbfaf3a8d83bdull, 0xea1ad565322a1a0bull, 0x60e61c23a3795013ull, 0x6606d7e446282b93ull,
    0x6ca4ecb15c5f91e1ull, 0x9f626da15c9625f3ull, 0xe51b38608ef25f57ull, 0x958a324ceb064572ull,
};

struct Input {
  uint8_t key[16];
  uint8_t msg[80];
  Input() {
    for (int i = 0; i < 16; ++i) key[i] = static_cast<uint8_t>(i);
    for (int i = 0; i < 80; ++i) msg[i] = static_cast<uint8_t>(i);
  }
};

TEST(SipHash, TheEmptyMessageMatchesTheReference) {
  Input in;
  EXPECT_EQ(siphash24(in.key, in.msg, 0), 0x726fdb47dd0e0e31ull);
  EXPECT_EQ(siphash24(in.key, nullptr, 0), 0x726fdb47dd0e0e31ull);
}

TEST(SipHash, TheFifteenByteMessageOfThePaperMatches) {
  Input in;
  EXPECT_EQ(siphash24(in.key, in.msg, 15), 0xa129ca6149be45e5ull);
}

TEST(SipHash, OneWholeBlockMatchesTheReference) {
  Input in;
  EXPECT_EQ(siphash24(in.key, in.msg, 8), 0x93f5f5799a932462ull);
}

TEST(SipHash, EveryLengthOfTheReferenceTableMatches) {
  Input in;
  for (size_t n = 0; n < 64; ++n)
    EXPECT_EQ(siphash24(in.key, in.msg, n), kReference[n]) << "length " << n;
}

TEST(SipHash, TheInputNeedNotBeAligned) {
  for (size_t shift = 1; shift < 8; ++shift) {
    std::vector<uint8_t> key(16 + shift), msg(64 + shift);
    for (size_t i = 0; i < 16; ++i) key[shift + i] = static_cast<uint8_t>(i);
    for (size_t i = 0; i < 64; ++i) msg[shift + i] = static_cast<uint8_t>(i);
    for (size_t n = 0; n < 64; ++n)
      ASSERT_EQ(siphash24(key.data() + shift, msg.data() + shift, n), kReference[n])
          << "shift " << shift << ", length " << n;
  }
}

TEST(SipHash, EveryLengthUpTo64RunsAndGivesItsOwnHash) {
  Input in;
  std::set<uint64_t> seen;
  for (size_t n = 0; n <= 64; ++n) seen.insert(siphash24(in.key, in.msg, n));
  EXPECT_EQ(seen.size(), 65u);
  // The length is part of the hash: zero bytes of different lengths differ.
  const uint8_t zeros[64] = {};
  std::set<uint64_t> zero_seen;
  for (size_t n = 0; n <= 64; ++n) zero_seen.insert(siphash24(in.key, zeros, n));
  EXPECT_EQ(zero_seen.size(), 65u);
}

TEST(SipHash, AnotherKeyGivesAnotherHash) {
  Input in;
  for (size_t n : {0, 1, 8, 15, 48}) {
    const uint64_t base = siphash24(in.key, in.msg, n);
    for (int bit = 0; bit < 128; ++bit) {
      uint8_t key[16];
      std::memcpy(key, in.key, sizeof(key));
      key[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      EXPECT_NE(siphash24(key, in.msg, n), base) << "length " << n << ", key bit " << bit;
    }
  }
  uint8_t zero_key[16] = {}, ones_key[16];
  std::memset(ones_key, 0xff, sizeof(ones_key));
  EXPECT_NE(siphash24(zero_key, in.msg, 16), siphash24(ones_key, in.msg, 16));
  EXPECT_NE(siphash24(zero_key, in.msg, 16), siphash24(in.key, in.msg, 16));
}

TEST(SipHash, AnotherMessageGivesAnotherHash) {
  Input in;
  const size_t n = 48;  // the size of the shm seal's message
  const uint64_t base = siphash24(in.key, in.msg, n);
  for (size_t bit = 0; bit < n * 8; ++bit) {
    uint8_t msg[48];
    std::memcpy(msg, in.msg, n);
    msg[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(siphash24(in.key, msg, n), base) << "message bit " << bit;
  }
}

TEST(SipHash, ItReadsNoByteBeyondTheLength) {
  Input in;
  for (size_t n = 0; n < 64; ++n) {
    std::vector<uint8_t> msg(in.msg, in.msg + n);
    msg.push_back(0xa5);  // a byte after the message must not matter
    const uint64_t with = siphash24(in.key, msg.data(), n);
    msg.back() = 0x5a;
    EXPECT_EQ(siphash24(in.key, msg.data(), n), with) << "length " << n;
    EXPECT_EQ(with, kReference[n]) << "length " << n;
  }
}

}  // namespace
}  // namespace mctest
