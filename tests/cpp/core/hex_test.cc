#include "core/hex.h"

#include <gtest/gtest.h>

namespace mooncake {
namespace {

TEST(Hex, RoundTripsEveryByte) {
  std::vector<uint8_t> bytes(256);
  for (int i = 0; i < 256; ++i) bytes[i] = static_cast<uint8_t>(i);
  const std::string hex = to_hex(bytes.data(), bytes.size());
  ASSERT_EQ(hex.size(), 512u);
  EXPECT_EQ(hex.substr(0, 6), "000102");
  EXPECT_EQ(hex.substr(506), "fdfeff");
  EXPECT_EQ(from_hex(hex), bytes);
  EXPECT_EQ(to_hex(nullptr, 0), "");
  EXPECT_EQ(from_hex(""), std::vector<uint8_t>{});
}

TEST(Hex, RefusesWhatIsNotLowercaseHexPairs) {
  for (const char* bad : {"a", "abc", "0g", "AB", "0 ", "-1", "zz00"})
    EXPECT_FALSE(from_hex(bad).has_value()) << bad;
  EXPECT_FALSE(from_hex(std::string_view("\0\0", 2)).has_value());
}

}  // namespace
}  // namespace mooncake
