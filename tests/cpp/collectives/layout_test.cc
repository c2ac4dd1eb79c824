// The segment layout: every flag and slot of every plane and peer has its own
// place, flags a cache line each, slots 64-byte aligned, all inside the segment.
#include "collectives/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "collectives/communicator.h"

namespace mctest {
namespace {

using mooncake::Layout;
using mooncake::Plane;

TEST(Layout, FlagsAndSlotsNeverOverlapAndFitTheSegment) {
  for (int capacity : {1, 3, 7, 64}) {
    for (size_t chunk : {64, 256, 4096}) {
      const Layout l = mooncake::make_layout(capacity, chunk);
      EXPECT_EQ(l.capacity, capacity);
      EXPECT_EQ(l.chunk_bytes, chunk);
      std::vector<std::pair<size_t, size_t>> regions;  // [begin, end)
      for (Plane plane : {Plane::kCollective, Plane::kP2P}) {
        for (int peer = 0; peer < capacity; ++peer) {
          for (size_t flag : {l.ready_flag(plane, peer), l.ack_flag(plane, peer)}) {
            EXPECT_EQ(flag % mooncake::kFlagStride, 0u);
            EXPECT_GE(flag, mooncake::kSegmentHeaderBytes);
            EXPECT_LE(flag + mooncake::kFlagStride, l.slots_begin());
            regions.emplace_back(flag, flag + mooncake::kFlagStride);
          }
          for (int region = 0; region < mooncake::kSlotRegions; ++region)
            for (int s = 0; s < mooncake::kSlotsPerChannel; ++s) {
              const size_t slot = l.slot(plane, peer, s, region);
              EXPECT_EQ(slot % 64, 0u);
              EXPECT_GE(slot, l.slots_begin());
              EXPECT_LE(slot + l.slot_bytes(), l.total_bytes());
              regions.emplace_back(slot, slot + l.slot_bytes());
            }
        }
      }
      std::sort(regions.begin(), regions.end());
      for (size_t i = 1; i < regions.size(); ++i)
        ASSERT_LE(regions[i - 1].second, regions[i].first)
            << "overlap at capacity " << capacity << ", chunk " << chunk;
      EXPECT_EQ(regions.back().second, l.total_bytes()) << "no slack after the last slot";
    }
  }
}

// Consecutive incarnations of a slot's process write into different regions,
// and every other incarnation into the same one.
TEST(Layout, IncarnationsAlternateBetweenTwoSlotRegions) {
  EXPECT_EQ(mooncake::slot_region(0), 0);
  EXPECT_EQ(mooncake::slot_region(1), 1);
  EXPECT_EQ(mooncake::slot_region(2), 0);
  EXPECT_EQ(mooncake::slot_region(7), 1);
  const Layout l = mooncake::make_layout(3, 256);
  EXPECT_NE(l.slot(Plane::kCollective, 2, 0, 0), l.slot(Plane::kCollective, 2, 0, 1));
}

TEST(Layout, ASlotIsAHeaderAndAChunk) {
  const Layout l = mooncake::make_layout(2, 256);
  EXPECT_EQ(l.slot_bytes(), sizeof(mooncake::MsgHeader) + 256);
  EXPECT_EQ(sizeof(mooncake::MsgHeader), 64u);
}

}  // namespace
}  // namespace mctest
