// The elastic EP slot table: states and their transitions, rank_bound over
// sparse active sets, replacement into the same slot, the mask as the RFC's
// query_mask_buffer writes it (1 = masked), and misuse refused by name.
#include "ep/slots.h"

#include <gtest/gtest.h>

#include <thread>

#include "errors.h"

namespace mctest {
namespace {

using mooncake::ErrorKind;
using mooncake::SlotState;
using mooncake::SlotTable;

std::vector<int32_t> mask_of(const SlotTable& t) {
  std::vector<int32_t> m(static_cast<size_t>(t.capacity()), -1);
  t.query_mask(m.data(), m.size());
  return m;
}

TEST(SlotTable, ARankAloneIsActiveInItsOwnSlotOnly) {
  SlotTable t(2, 8);
  EXPECT_EQ(t.active_slots(), std::vector<int>{2});
  EXPECT_EQ(t.rank_bound(), 3);
  EXPECT_EQ(t.num_active(), 1);
  EXPECT_EQ(mask_of(t), (std::vector<int32_t>{1, 1, 0, 1, 1, 1, 1, 1}));
}

TEST(SlotTable, StagingKeepsAPeerMaskedUntilItIsPublished) {
  SlotTable t(0, 4);
  t.connect(1, /*activate=*/false);
  EXPECT_EQ(t.state(1), SlotState::kStaged);
  EXPECT_EQ(t.rank_bound(), 1) << "a staged peer takes no part yet";
  EXPECT_EQ(mask_of(t), (std::vector<int32_t>{0, 1, 1, 1}));
  t.set_masked(1, false);
  EXPECT_EQ(t.state(1), SlotState::kActive);
  EXPECT_EQ(t.rank_bound(), 2);
  t.set_masked(1, false);  // idempotent
  t.set_masked(1, true);   // masked again, still connected
  EXPECT_EQ(t.state(1), SlotState::kStaged);
  t.connect(3, /*activate=*/true);
  EXPECT_EQ(t.active_slots(), (std::vector<int>{0, 3}));
}

TEST(SlotTable, GrowthOneTwoFourEightKeepsSlotIndices) {
  SlotTable t(0, 16);
  for (int size : {2, 4, 8, 16}) {
    for (int q = size / 2; q < size; ++q) t.connect(q, false);
    for (int q = size / 2; q < size; ++q) t.set_masked(q, false);
    EXPECT_EQ(t.rank_bound(), size);
    EXPECT_EQ(t.num_active(), size);
  }
}

TEST(SlotTable, ASparseSetKeepsGlobalRankIndexedBounds) {
  SlotTable t(0, 8);
  for (int q = 1; q < 8; ++q) t.connect(q, true);
  for (int q : {1, 2, 4, 5, 6, 7}) t.disconnect(q);
  EXPECT_EQ(t.active_slots(), (std::vector<int>{0, 3}));
  EXPECT_EQ(t.num_active(), 2);
  EXPECT_EQ(t.rank_bound(), 4) << "a layout indexed by global rank must reach slot 3";
  EXPECT_EQ(mask_of(t), (std::vector<int32_t>{0, 1, 1, 0, 1, 1, 1, 1}));
}

TEST(SlotTable, AReplacementReconnectsIntoTheSameSlotWithANewGeneration) {
  SlotTable t(1, 4);
  t.connect(2, true);
  const uint64_t first = t.generation(2);
  EXPECT_TRUE(t.mark_failed(2)) << "a receive timeout masks the silent peer";
  EXPECT_EQ(t.state(2), SlotState::kStaged);
  EXPECT_FALSE(t.mark_failed(2)) << "already masked";
  t.disconnect(2);
  EXPECT_EQ(t.state(2), SlotState::kDisconnected);
  t.connect(2, false);
  t.set_masked(2, false);
  EXPECT_GT(t.generation(2), first);
  EXPECT_EQ(t.active_slots(), (std::vector<int>{1, 2}));
}

TEST(SlotTable, MisuseIsRefusedNamingTheCallAndTheRank) {
  SlotTable t(0, 4);
  auto bad = [](const std::function<void()>& fn, const char* contains) {
    return throws_error(ErrorKind::kInvalidArgument, fn, contains);
  };
  EXPECT_TRUE(bad([&] { t.connect(0, false); }, "connect_ranks: rank 0 is this rank itself"));
  EXPECT_TRUE(bad([&] { t.connect(4, false); }, "connect_ranks: rank 4 is outside the capacity"));
  EXPECT_TRUE(bad([&] { t.connect(-1, false); }, "outside the capacity [0, 4)"));
  t.connect(1, false);
  EXPECT_TRUE(bad([&] { t.connect(1, true); }, "rank 1 is already staged"));
  EXPECT_TRUE(bad([&] { t.set_masked(2, false); }, "update_mask_buffer: rank 2 is not connected"));
  EXPECT_TRUE(bad([&] { t.disconnect(3); }, "disconnect_ranks: rank 3 is not connected"));
  EXPECT_TRUE(bad([&] { t.disconnect(0); }, "rank 0 is this rank itself"));
  std::vector<int32_t> short_out(3);
  EXPECT_TRUE(bad([&] { t.query_mask(short_out.data(), short_out.size()); },
                  "must have 4 entries (the capacity), got 3"));
  EXPECT_TRUE(bad([] { SlotTable(0, 0); }, "num_ranks (the capacity) must be >= 1"));
  EXPECT_TRUE(bad([] { SlotTable(4, 4); }, "this rank (4) must be below the capacity (4)"));
  EXPECT_EQ(t.describe(), "0:A 1:S 2:- 3:-");
}

TEST(SlotTable, ConcurrentCallsAreSerialised) {
  SlotTable t(0, 64);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&t, k] {
      for (int round = 0; round < 200; ++round)
        for (int q = 1 + k; q < 64; q += 4) {
          t.connect(q, round % 2 == 0);
          t.set_masked(q, false);
          t.disconnect(q);
        }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(t.active_slots(), std::vector<int>{0});
  EXPECT_EQ(t.generation(5), 200u);
}

}  // namespace
}  // namespace mctest
