// A rank that loses the store while a recovery is on (its host cut off: the
// store no longer answers it) cannot take part in the agreement: its op ends
// with kLeftOut at once, instead of retrying until the store answers again,
// and the ranks that reach the store go on without it.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>

#include "collectives/group.h"
#include "core/clock.h"
#include "errors.h"
#include "store/store.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::ErrorKind;

// The run's store, until cut(): then every request fails as a store out of
// reach does (C10dStore's bounded requests).
class CuttableStore : public mooncake::Store {
 public:
  explicit CuttableStore(mooncake::Store& inner) : inner_(inner) {}
  void cut() { cut_ = true; }
  int requests_after_cut() const { return after_cut_; }

  void set(const std::string& k, const std::string& v) override {
    check_cut(k);
    inner_.set(k, v);
  }
  std::string get(const std::string& k, int64_t timeout_ms) override {
    check_cut(k);
    return inner_.get(k, timeout_ms);
  }
  int64_t add(const std::string& k, int64_t d) override {
    check_cut(k);
    return inner_.add(k, d);
  }
  bool check(const std::string& k) override {
    check_cut(k);
    return inner_.check(k);
  }
  std::string compare_set(const std::string& k, const std::string& v) override {
    check_cut(k);
    return inner_.compare_set(k, v);
  }

 private:
  void check_cut(const std::string& key) {
    if (!cut_) return;
    ++after_cut_;
    mooncake::throw_error(ErrorKind::kTimeout, -1, mooncake::kStoreUnreachable, ": check '", key,
                          "' had no answer (test)");
  }
  mooncake::Store& inner_;
  std::atomic<bool> cut_{false};
  std::atomic<int> after_cut_{0};
};

TEST(LostStore, TheRankThatLostItIsLeftOutAtOnceAndTheOthersGoOn) {
  GroupOptions o;
  o.op_timeout_ms = 1500;
  run_ranks(3, [&](Rank& r) {
    CuttableStore store(r.store);
    Communicator comm(engine_for(o), store, "group/", r.rank, r.size, comm_config(o));
    EXPECT_EQ(member_mask(comm), 0b111);
    store_barrier(r.store, "first op done", r.rank, r.size);
    if (r.rank == 0) exit_rank_abruptly();  // a failure: ranks 1 and 2 must agree
    if (r.rank == 2) store.cut();
    const int64_t start = mooncake::now_us();
    if (r.rank == 2) {
      EXPECT_TRUE(throws_error(ErrorKind::kLeftOut, [&] { member_mask(comm); }, "lost the store"));
      EXPECT_LT((mooncake::now_us() - start) / 1000, 1000) << "decided at the first request";
      EXPECT_LE(store.requests_after_cut(), 2) << "no retrying against a lost store";
      return;
    }
    // Rank 1 waits out rank 2's report (it looks alive) until the op's deadline.
    EXPECT_EQ(member_mask(comm), 0b010);
    EXPECT_LT((mooncake::now_us() - start) / 1000, 3 * o.op_timeout_ms);
  });
}

}  // namespace
}  // namespace mctest
