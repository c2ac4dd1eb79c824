// FileStore: values round-trip exactly, get waits (bounded) for a key another
// process sets, add is atomic across processes, and distinct keys never
// share a value.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "errors.h"
#include "harness.h"
#include "store/store.h"

namespace mctest {
namespace {

using mooncake::ErrorKind;
using mooncake::FileStore;

class FileStoreTest : public testing::Test {
 protected:
  TempDir dir_;
  FileStore store_{dir_.path() + "/store"};
};

TEST_F(FileStoreTest, SetThenGetReturnsTheExactBytes) {
  const std::string value("line one\nline two\0with a nul\xff", 30);
  store_.set("k", value);
  EXPECT_EQ(store_.get("k", 0), value);
  store_.set("empty", "");
  EXPECT_EQ(store_.get("empty", 0), "");
}

TEST_F(FileStoreTest, SetOverwrites) {
  store_.set("k", "first");
  store_.set("k", "second");
  EXPECT_EQ(store_.get("k", 0), "second");
}

TEST_F(FileStoreTest, CheckSaysWhetherAKeyWasSet) {
  EXPECT_FALSE(store_.check("k"));
  store_.set("k", "v");
  EXPECT_TRUE(store_.check("k"));
}

TEST_F(FileStoreTest, GetOfAMissingKeyTimesOutAfterItsTimeout) {
  const int64_t start = mooncake::now_us();
  EXPECT_TRUE(throws_error(ErrorKind::kTimeout, [&] { store_.get("missing", 50); }));
  const int64_t elapsed_ms = (mooncake::now_us() - start) / 1000;
  EXPECT_GE(elapsed_ms, 50);
  EXPECT_LT(elapsed_ms, 1000);
}

TEST_F(FileStoreTest, GetWaitsForAKeyThatAnotherProcessSetsLater) {
  run_ranks(2, [](Rank& r) {
    if (r.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      r.store.set("late", "here");
    } else {
      EXPECT_EQ(r.store.get("late", 5000), "here");
    }
  });
}

TEST_F(FileStoreTest, AddStartsAtZeroAndReturnsTheNewValue) {
  EXPECT_EQ(store_.add("n", 5), 5);
  EXPECT_EQ(store_.add("n", -7), -2);
  EXPECT_EQ(store_.get("n", 0), "-2");
  store_.set("m", "40");
  EXPECT_EQ(store_.add("m", 2), 42);
}

TEST_F(FileStoreTest, AddIsAtomicAcrossProcesses) {
  constexpr int kRanks = 4, kAdds = 50;
  run_ranks(kRanks, [](Rank& r) {
    for (int i = 0; i < kAdds; ++i) r.store.add("counter", 1);
    store_barrier(r.store, "added", r.rank, r.size);
    EXPECT_EQ(r.store.get("counter", 0), std::to_string(kRanks * kAdds));
  });
}

TEST_F(FileStoreTest, ConcurrentSetsOfOneKeyFromThreadsOfOneProcessAllSucceed) {
  std::atomic<int> failures{0};
  std::string first_failure;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        try {
          store_.set("shared", std::string(100 + t, static_cast<char>('a' + t)));
        } catch (const std::exception& e) {
          if (failures++ == 0) first_failure = e.what();
        }
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0) << "of 800 sets; the first: " << first_failure;
  const std::string v = store_.get("shared", 0);
  ASSERT_GE(v.size(), 100u);
  EXPECT_EQ(v, std::string(v.size(), static_cast<char>('a' + (v.size() - 100)))) << "a torn value";
}

TEST_F(FileStoreTest, KeysWithSlashesAreDistinctFromEveryOtherKey) {
  store_.set("a/b", "slash");
  store_.set("a%b", "percent");
  store_.set("a_b", "underscore");
  EXPECT_EQ(store_.get("a/b", 0), "slash");
  EXPECT_EQ(store_.get("a%b", 0), "percent");
  EXPECT_EQ(store_.get("a_b", 0), "underscore");
}

TEST_F(FileStoreTest, OnlyKeysThatWereSetExist) {
  store_.add("counter", 1);
  store_.set("k", "v");
  EXPECT_FALSE(store_.check("counter.lock")) << "add's lock file shows as a key";
  EXPECT_TRUE(throws_error(ErrorKind::kTimeout, [&] { store_.get("counter.lock", 0); }));
}

}  // namespace
}  // namespace mctest
