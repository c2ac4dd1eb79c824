// copy_past_cache: the same bytes as memcpy, for every length and alignment
// around its 16-byte stores and 64-byte steps, and nothing outside them.
#include "core/copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace {

TEST(CopyPastCache, CopiesExactlyTheBytesAtEveryLengthAndAlignment) {
  const std::vector<size_t> lengths = {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4099};
  std::vector<uint8_t> src(4099 + 64), dst(4099 + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t len : lengths) {
    for (size_t to = 0; to < 33; ++to) {
      for (size_t from = 0; from < 4; ++from) {
        std::fill(dst.begin(), dst.end(), uint8_t{0xA5});
        mooncake::copy_past_cache(dst.data() + to, src.data() + from, len);
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= to && i < to + len;
          const uint8_t want = inside ? src[from + i - to] : uint8_t{0xA5};
          ASSERT_EQ(dst[i], want) << "len " << len << " to +" << to << " from +" << from << " byte "
                                  << i;
        }
      }
    }
  }
}

}  // namespace
