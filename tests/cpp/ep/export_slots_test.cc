// The export slots of the ElasticBuffer's one copy (device/export_slots.h): an
// allocation keeps its slot and generation while it is offered; a new one
// takes an empty slot, then the least recently offered; every export's
// generation is new (never 0), so a reader of a slot tells a re-export from
// the one it mapped; refused allocations are remembered, a few at a time.
#include "device/export_slots.h"

#include <gtest/gtest.h>

#include <set>

namespace mctest {
namespace {

using Slots = mooncake::ExportSlots<3>;

TEST(ExportSlots, AnAllocationKeepsItsSlotAndGeneration) {
  Slots s;
  EXPECT_FALSE(s.find(7).has_value());
  const Slots::Pick p = s.assign(7);
  EXPECT_NE(p.gen, 0u);
  for (int i = 0; i < 3; ++i) {
    const auto again = s.find(7);
    ASSERT_TRUE(again.has_value());
    EXPECT_EQ(again->slot, p.slot);
    EXPECT_EQ(again->gen, p.gen);
  }
}

TEST(ExportSlots, EmptySlotsFirstThenTheLeastRecentlyOffered) {
  Slots s;
  std::set<int> used;
  for (uint64_t id : {1, 2, 3}) used.insert(s.assign(id).slot);
  EXPECT_EQ(used.size(), 3u);
  ASSERT_TRUE(s.find(1).has_value());  // 1 offered again: 2 is now the oldest
  const int slot_of_2 = s.find(2)->slot;
  ASSERT_TRUE(s.find(3).has_value());
  ASSERT_TRUE(s.find(1).has_value());
  const Slots::Pick p = s.assign(4);
  EXPECT_EQ(p.slot, slot_of_2);
  EXPECT_FALSE(s.find(2).has_value());
  EXPECT_TRUE(s.find(1).has_value());
  EXPECT_TRUE(s.find(3).has_value());
}

TEST(ExportSlots, EveryExportHasANewNonZeroGeneration) {
  Slots s;
  std::set<uint32_t> gens;
  for (uint64_t id = 1; id <= 50; ++id) {
    const Slots::Pick p = s.assign(id % 5 + 1);  // the same ids come back: re-exported
    EXPECT_NE(p.gen, 0u);
    EXPECT_TRUE(gens.insert(p.gen).second) << "generation " << p.gen << " given twice";
  }
}

TEST(ExportSlots, RefusedAllocationsAreRememberedAFewAtATime) {
  Slots s;
  EXPECT_FALSE(s.refused(9));
  s.refuse(9);
  EXPECT_TRUE(s.refused(9));
  EXPECT_FALSE(s.refused(0));                            // 0 is no allocation
  for (uint64_t id = 100; id < 108; ++id) s.refuse(id);  // 8 more: 9 is forgotten
  EXPECT_FALSE(s.refused(9));
  EXPECT_TRUE(s.refused(107));
}

}  // namespace
}  // namespace mctest
