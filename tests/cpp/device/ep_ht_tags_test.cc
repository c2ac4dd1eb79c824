// The ElasticBuffer kernels' call tags (kernels/ep_ht/api.h), on the host: never
// 0 (a cleared word), never the same for consecutive calls, and ordered by the
// serial comparison the layout pass uses to tell a later call's record, across
// the wrap at 2^32 too. No GPU needed.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/ep_ht/api.h"

namespace mctest {
namespace {

using mooncake::kernels::ep_ht::tag_of;

bool later(uint32_t t, uint32_t tag) {  // as the layout pass reads a record's tag
  return static_cast<int32_t>(t - tag) > 0;
}

TEST(EpHtTags, NeverZeroAndNeverRepeatedByTheNextCall) {
  const uint64_t wrap = uint64_t{1} << 32;
  for (const uint64_t base : {uint64_t{0}, wrap - 3, 2 * wrap - 5, 5 * wrap - 2}) {
    for (uint64_t seq = base; seq < base + 8; ++seq) {
      SCOPED_TRACE(seq);
      EXPECT_NE(tag_of(seq), 0u);
      EXPECT_NE(tag_of(seq), tag_of(seq + 1));
      EXPECT_TRUE(later(tag_of(seq + 1), tag_of(seq)));
      EXPECT_FALSE(later(tag_of(seq), tag_of(seq + 1)));
    }
  }
  EXPECT_EQ(tag_of(1), 2u);
  EXPECT_EQ(tag_of(0xfffffffeull), 0xffffffffu);
  EXPECT_EQ(tag_of(0xffffffffull), 1u);
}

}  // namespace
}  // namespace mctest
