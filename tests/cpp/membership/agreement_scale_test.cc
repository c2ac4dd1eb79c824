// agree_on_view at 1024 ranks, simulated in one process: a thread per rank
// over one in-memory store, with deaths and a partition injected. What it
// checks, round after round: every rank that takes part and is not left out
// decides the same view, which holds exactly the ranks that reported; ranks
// cut off from the store learn they were left out once they reach it again;
// and no round waits for its deadline. It also counts the store calls of a
// round, which is what a real store (one TCPStore server) pays for.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "membership/agreement.h"
#include "store/store.h"

namespace mctest {
namespace {

using mooncake::Deadline;
using mooncake::Decision;
using mooncake::Error;
using mooncake::ErrorKind;
using mooncake::Report;
using mooncake::View;

constexpr int kRanks = 1024;
constexpr int64_t kDeadlineMs = 60000;  // far past what a round takes here

// One shared in-memory store; counts every call.
class MemStore : public mooncake::Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    map_[key] = value;
    cv_.notify_all();
  }
  std::string get(const std::string& key, int64_t timeout_ms) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++calls_;
    if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                      [&] { return map_.count(key) != 0; }))
      mooncake::throw_error(ErrorKind::kTimeout, -1, "MemStore: no key ", key);
    return map_[key];
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    int64_t v = map_.count(key) ? std::stoll(map_[key]) : 0;
    map_[key] = std::to_string(v += delta);
    return v;
  }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    return map_.count(key) != 0;
  }
  std::string compare_set(const std::string& key, const std::string& desired) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    auto it = map_.find(key);
    if (it == map_.end()) it = map_.emplace(key, desired).first;
    cv_.notify_all();
    return it->second;
  }
  uint64_t calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> map_;
  uint64_t calls_ = 0;
};

// A rank's way to the store: until `open` is set, every call after the first
// `free_calls` waits (with none free the rank is cut off, as by a partition,
// and neither reports nor reads).
class Gate : public mooncake::Store {
 public:
  Gate(mooncake::Store& inner, std::atomic<bool>* open, int free_calls = 0)
      : inner_(inner), open_(open), free_(free_calls) {}
  void set(const std::string& k, const std::string& v) override {
    pass();
    inner_.set(k, v);
  }
  std::string get(const std::string& k, int64_t t) override {
    pass();
    return inner_.get(k, t);
  }
  int64_t add(const std::string& k, int64_t d) override {
    pass();
    return inner_.add(k, d);
  }
  bool check(const std::string& k) override {
    pass();
    return inner_.check(k);
  }
  std::string compare_set(const std::string& k, const std::string& v) override {
    pass();
    return inner_.compare_set(k, v);
  }

 private:
  void pass() {
    if (free_ > 0) {
      --free_;
      return;
    }
    while (open_ != nullptr && !open_->load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  mooncake::Store& inner_;
  std::atomic<bool>* open_;
  int free_;
};

Report report_of(int rank, uint64_t epoch) {
  Report r;
  r.rank = rank;
  r.pending = 1000 * epoch + 7;
  r.done = r.pending - 1;
  r.has_result = rank % 2 == 0;
  r.attempts = rank % 3;
  return r;
}

struct Outcome {
  bool decided = false;
  bool left_out = false;
  bool before_deadline = false;
  Decision decision;
  std::string error;
};

// One round at `current`: `dead` never take part (and probe as gone);
// `cut` take part behind a gate that opens once every other participant has
// returned (they probe as gone to the others meanwhile, as a partition's far
// side does); `stalled` report, then stall behind the same gate while they
// still probe as alive. Returns each rank's outcome and the round's store calls.
std::map<int, Outcome> run_round(MemStore& store, const View& current, const std::set<int>& dead,
                                 const std::set<int>& cut, const std::set<int>& stalled,
                                 uint64_t* calls) {
  const uint64_t before = store.calls();
  std::atomic<bool> open{false};
  std::map<int, Outcome> out;
  std::vector<int> ranks;
  for (int r : current.members())
    if (!dead.count(r)) {
      ranks.push_back(r);
      out[r] = Outcome{};
    }
  std::atomic<int> near_left{static_cast<int>(ranks.size() - cut.size() - stalled.size())};
  auto body = [&](int r) {
    const bool held = cut.count(r) || stalled.count(r);
    // A stalled rank's first two calls (its count and its report) go through.
    Gate gate(store, held ? &open : nullptr, stalled.count(r) ? 2 : 0);
    // Ranks on the near side see the dead and the cut-off as gone; the cut-off
    // ones see the near side as alive (they cannot reach the store anyway).
    mooncake::Probe alive = [&](int q) { return !dead.count(q) && !cut.count(q); };
    const Deadline deadline = Deadline::after_ms(kDeadlineMs);
    Outcome& o = out[r];
    try {
      o.decision = mooncake::agree_on_view(gate, "g/", current, report_of(r, current.epoch), alive,
                                           deadline);
      o.decided = true;
    } catch (const Error& e) {
      o.left_out = e.kind() == ErrorKind::kLeftOut && e.peer() == r;
      o.error = e.what();
    }
    o.before_deadline = !deadline.expired();
    if (!held && --near_left == 0) open.store(true);
  };
  std::vector<std::thread> threads;
  threads.reserve(ranks.size());
  for (int r : ranks) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
  *calls = store.calls() - before;
  return out;
}

TEST(AgreementAtScale, ThousandRanksAgreeThroughDeathsAndAPartition) {
  MemStore store;
  View view = View::initial(kRanks, kRanks);
  std::mt19937 rng(2026);
  // Round 0: 16 ranks dead (rank 0 among them). Round 1: a partition cuts 100
  // ranks off the store. Round 2: 8 more dead and everyone else reports.
  // Round 3: the lowest member (the first to gather) stalls right after its
  // report: the next in line must take over, and it is in the view.
  std::set<int> dead1{0};
  while (dead1.size() < 16) dead1.insert(static_cast<int>(rng() % kRanks));
  std::set<int> cut2;
  for (int r : view.members())
    if (!dead1.count(r) && cut2.size() < 100 && rng() % 5 == 0) cut2.insert(r);
  const std::vector<std::pair<std::set<int>, std::set<int>>> rounds = {
      {dead1, {}}, {{}, cut2}, {{}, {}}, {{}, {}}};
  for (size_t k = 0; k < rounds.size(); ++k) {
    std::set<int> dead = rounds[k].first;
    const std::set<int>& cut = rounds[k].second;
    std::set<int> stalled;
    if (k == 2) {  // 8 more deaths among the current members
      const std::vector<int> m = view.members();
      while (dead.size() < 8) dead.insert(m[rng() % m.size()]);
    }
    if (k == 3) stalled.insert(view.members().front());
    uint64_t calls = 0;
    const auto t0 = std::chrono::steady_clock::now();
    const std::map<int, Outcome> out = run_round(store, view, dead, cut, stalled, &calls);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    View expected = view;
    expected.epoch = view.epoch + 1;
    for (int q : view.members()) {
      expected.active[static_cast<size_t>(q)] = !dead.count(q) && !cut.count(q);
      expected.since[static_cast<size_t>(q)] = expected.epoch;
    }
    int decided = 0, left_out = 0;
    for (const auto& [r, o] : out) {
      EXPECT_TRUE(o.before_deadline)
          << "round " << k << ": rank " << r << " waited for the deadline";
      if (cut.count(r)) {
        EXPECT_TRUE(o.left_out) << "round " << k << ": cut-off rank " << r << ": " << o.error;
        left_out += o.left_out;
        continue;
      }
      ASSERT_TRUE(o.decided) << "round " << k << ": rank " << r << ": " << o.error;
      EXPECT_EQ(o.decision.view, expected) << "round " << k << ": rank " << r;
      ASSERT_EQ(o.decision.reports.size(), static_cast<size_t>(expected.num_members()));
      for (const Report& rep : o.decision.reports)
        EXPECT_EQ(rep, report_of(rep.rank, view.epoch)) << "round " << k;
      ++decided;
    }
    EXPECT_EQ(decided, expected.num_members());
    EXPECT_EQ(left_out, static_cast<int>(cut.size()));
    std::printf(
        "round %zu: %d ranks decided epoch %llu (%d members), %d left out, %.2f s, %llu "
        "store calls\n",
        k, decided, static_cast<unsigned long long>(expected.epoch), expected.num_members(),
        left_out, seconds, static_cast<unsigned long long>(calls));
    view = expected;
  }
}

}  // namespace
}  // namespace mctest
