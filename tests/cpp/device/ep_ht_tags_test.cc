// The ElasticBuffer kernels' call tags (kernels/ep_ht/api.h), on the host: never
// 0 (a cleared word), never the same for consecutive calls, and ordered by the
// serial comparison the layout pass uses to tell a later call's record, across
// the wrap at 2^32 too. No GPU needed.
#include <gtest/gtest.h>

#include <cstdint>
#include <iterator>

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

// The workspace's regions (one copy's offers, answers, records and exports
// among them) follow each other without overlap, each 128-byte aligned, for
// any ranks and channels; the rings get what is left.
TEST(EpHtLayout, RegionsFollowEachOtherWithoutOverlap) {
  using mooncake::kernels::ep_ht::HtLayout;
  using mooncake::kernels::ep_ht::kXExportBytes;
  using mooncake::kernels::ep_ht::kXSlots;
  using mooncake::kernels::ep_ht::XShare;
  for (const int64_t R : {1, 2, 8, 64})
    for (const int64_t C : {1, 3, 256}) {
      SCOPED_TRACE(testing::Message() << R << " ranks, " << C << " channels");
      const HtLayout l(R, C, 1 << 20);
      const size_t starts[] = {l.notify, l.xdesc, l.xack,  l.xrec,  l.xexp,
                               l.dtail,  l.dhead, l.ctail, l.chead, l.rings};
      for (size_t s : starts) EXPECT_EQ(s % HtLayout::kAlign, 0u);
      for (size_t i = 1; i < std::size(starts); ++i) EXPECT_LT(starts[i - 1], starts[i]);
      EXPECT_LE(l.offer(R - 1, C - 1) + 8, l.xack);
      EXPECT_LE(l.answer(R - 1, C - 1) + 8, l.xrec);
      EXPECT_LE(l.share(C - 1) + sizeof(XShare), l.xexp);
      EXPECT_LE(l.exported(kXSlots - 1) + kXExportBytes, l.dtail);
      EXPECT_EQ(l.ring_bytes(), size_t{1} << 20);
    }
}

}  // namespace
}  // namespace mctest
