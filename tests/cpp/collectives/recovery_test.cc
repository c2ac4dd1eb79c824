// When ranks die, hang or stay away, the survivors agree on the new group
// and every op completes among them, with the same result on every survivor.
//
// Each rank r contributes 1 << r, so a sum (or the zero-filled slices of a
// gather) spells out exactly the set of ranks an op was computed over.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <thread>

#include "collectives/group.h"
#include "core/clock.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::ErrorKind;
using mooncake::RedOp;

int64_t mask_of(const std::vector<int>& ranks) {
  int64_t m = 0;
  for (int r : ranks) m |= int64_t{1} << r;
  return m;
}

std::vector<int> all_but(int size, const std::vector<int>& gone) {
  std::vector<int> out;
  for (int r = 0; r < size; ++r)
    if (std::find(gone.begin(), gone.end(), r) == gone.end()) out.push_back(r);
  return out;
}

// The set the communicator last showed its view listener (what the torch
// backend copies into active_ranks), watched from the first call on.
int64_t shown_mask(Communicator& comm) {
  static bool watching = false;  // per process: each rank is one
  static int64_t shown = 0;
  if (!watching) {
    watching = true;
    shown = mask_of(comm.view().members());
    comm.set_view_listener([](const mooncake::View& view) { shown = mask_of(view.members()); });
  }
  return shown;
}

// Runs one op of each shape and returns the set (mask) each was computed
// over; every element of an op's result must spell the same set, and the
// view shown after the op must be that set.
std::vector<int64_t> run_every_shape(Communicator& comm, int size, size_t count) {
  std::vector<int64_t> masks;
  shown_mask(comm);
  auto check_shown = [&] {
    EXPECT_EQ(shown_mask(comm), masks.back())
        << "op " << masks.size() - 1 << " covered another set than the view shown after it";
  };
  const int64_t mine = int64_t{1} << comm.rank();
  auto uniform = [&](const std::vector<int64_t>& v) {
    for (int64_t x : v) EXPECT_EQ(x, v.empty() ? 0 : v[0]);
    return v.empty() ? 0 : v[0];
  };
  {  // all_reduce
    std::vector<int64_t> v(count, mine);
    comm.all_reduce(v.data(), count, DType::kInt64, RedOp::kSum);
    masks.push_back(uniform(v));
    check_shown();
  }
  {  // all_gather: slices of ranks outside the group are zero-filled
    std::vector<std::vector<int64_t>> outs(size, std::vector<int64_t>(count, -1));
    std::vector<void*> ptrs;
    for (auto& o : outs) ptrs.push_back(o.data());
    std::vector<int64_t> in(count, mine);
    comm.all_gather(in.data(), count, DType::kInt64, ptrs.data());
    int64_t m = 0;
    for (int p = 0; p < size; ++p) m |= uniform(outs[p]);
    masks.push_back(m);
    check_shown();
  }
  {  // reduce_scatter
    std::vector<std::vector<int64_t>> ins(size, std::vector<int64_t>(count, mine));
    std::vector<const void*> ptrs;
    for (auto& i : ins) ptrs.push_back(i.data());
    std::vector<int64_t> out(count, -1);
    comm.reduce_scatter(ptrs.data(), out.data(), count, DType::kInt64, RedOp::kSum);
    masks.push_back(uniform(out));
    check_shown();
  }
  {  // all_to_all
    std::vector<std::vector<int64_t>> ins(size, std::vector<int64_t>(count, mine));
    std::vector<std::vector<int64_t>> outs(size, std::vector<int64_t>(count, -1));
    std::vector<const void*> in_ptrs;
    std::vector<void*> out_ptrs;
    std::vector<size_t> counts(size, count);
    for (int p = 0; p < size; ++p) {
      in_ptrs.push_back(ins[p].data());
      out_ptrs.push_back(outs[p].data());
    }
    comm.all_to_all(in_ptrs.data(), counts.data(), out_ptrs.data(), counts.data(), DType::kInt64);
    int64_t m = 0;
    for (int p = 0; p < size; ++p) m |= uniform(outs[p]);
    masks.push_back(m);
    check_shown();
  }
  comm.barrier();
  return masks;
}

class Recovery : public GroupTest {};

TEST_P(Recovery, SurvivorsCompleteEveryShapeWhenRankZeroAndTheLastHaveExited) {
  GroupOptions o = options();
  o.op_timeout_ms = 20000;
  run(o, [](Communicator& comm, Rank& r) {
    const std::vector<int> gone =
        r.size > 2 ? std::vector<int>{0, r.size - 1} : std::vector<int>{r.size - 1};
    if (std::find(gone.begin(), gone.end(), r.rank) != gone.end()) exit_rank_abruptly();
    const std::vector<int> survivors = all_but(r.size, gone);
    const int64_t start = mooncake::now_us();
    for (size_t count : {size_t{1}, size_t{1001}}) {
      for (int64_t m : run_every_shape(comm, r.size, count))
        EXPECT_EQ(m, mask_of(survivors)) << count << " elements";
    }
    EXPECT_LT(mooncake::now_us() - start, 3'000'000) << "far sooner than the 20 s timeout";
    EXPECT_EQ(comm.view().members(), survivors);
    EXPECT_GE(comm.view().epoch, 1u);
    const int index =
        static_cast<int>(std::find(survivors.begin(), survivors.end(), r.rank) - survivors.begin());
    store_barrier(r.store, "survivors done", index, static_cast<int>(survivors.size()));
  });
}

TEST_P(Recovery, RootedOpsFromADeadRootFailOnEverySurvivorAndTheGroupGoesOn) {
  run([](Communicator& comm, Rank& r) {
    const int dead = 1;
    if (r.rank == dead) exit_rank_abruptly();
    std::vector<int64_t> v(40, int64_t{1} << r.rank);
    auto expect_root_error = [&](const char* what, const std::function<void()>& op) {
      try {
        op();
        ADD_FAILURE() << what << " completed from a dead root";
      } catch (const mooncake::Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kPeerFailed) << e.what();
        EXPECT_EQ(e.peer(), dead) << e.what();
      }
    };
    expect_root_error("broadcast",
                      [&] { comm.broadcast(v.data(), v.size(), DType::kInt64, dead); });
    expect_root_error("reduce",
                      [&] { comm.reduce(v.data(), v.size(), DType::kInt64, RedOp::kSum, dead); });
    std::vector<int64_t> sum(3, int64_t{1} << r.rank);
    comm.all_reduce(sum.data(), sum.size(), DType::kInt64, RedOp::kSum);
    EXPECT_EQ(sum[0], mask_of(all_but(r.size, {dead})));
  });
}

// A member that names a dead root while the others name a live one gets the
// same mismatch as they do, in the same op: nobody runs ahead of the others.
TEST_P(Recovery, RanksNamingADeadAndALiveRootAllGetAMismatchAndStayInStep) {
  run([](Communicator& comm, Rank& r) {
    const int dead = r.size - 1;
    if (r.size < 3) return;
    if (r.rank == dead) exit_rank_abruptly();
    std::vector<int64_t> sum(3, int64_t{1} << r.rank);
    comm.all_reduce(sum.data(), sum.size(), DType::kInt64, RedOp::kSum);  // every view moved on
    const std::vector<int> survivors = all_but(r.size, {dead});
    ASSERT_EQ(comm.view().members(), survivors);
    for (size_t count : {size_t{5}, size_t{100000}}) {
      std::vector<int64_t> v(count, r.rank);
      const int root = r.rank == 0 ? dead : 0;
      EXPECT_TRUE(throws_error(
          ErrorKind::kInvalidArgument,
          [&] { comm.broadcast(v.data(), count, DType::kInt64, root); }, "root ranks differ"))
          << count << " elements";
      sum.assign(3, int64_t{1} << r.rank);
      comm.all_reduce(sum.data(), sum.size(), DType::kInt64, RedOp::kSum);
      EXPECT_EQ(sum[0], mask_of(survivors));
    }
  });
}

TEST_P(Recovery, AStoppedRankIsLeftOutAfterTheHangLimit) {
  GroupOptions o = options();
  o.op_timeout_ms = 20000;
  o.hang_ms = 300;
  run(o, [](Communicator& comm, Rank& r) {
    const int stopped = r.size - 1;
    if (r.rank == stopped) {
      r.store.set("pid", std::to_string(::getpid()));
      ::raise(SIGSTOP);
      exit_rank_abruptly();  // resumed by a survivor once it is no longer needed
    }
    const int64_t start = mooncake::now_us();
    std::vector<int64_t> v(5, int64_t{1} << r.rank);
    comm.all_reduce(v.data(), v.size(), DType::kInt64, RedOp::kSum);
    EXPECT_EQ(v[0], mask_of(all_but(r.size, {stopped})));
    const int64_t ms = (mooncake::now_us() - start) / 1000;
    EXPECT_GE(ms, 250) << "a stopped rank looks alive until the hang limit";
    EXPECT_LT(ms, 2500);
    store_barrier(r.store, "survivors done", r.rank, r.size - 1, 10000);
    if (r.rank == 0) ::kill(std::stoi(r.store.get("pid", 1000)), SIGCONT);
  });
}

TEST_P(Recovery, ARankThatNeverCallsTheOpIsLeftOutAboutOneTimeoutAfterTheOpBegan) {
  GroupOptions o = options();
  o.op_timeout_ms = 300;
  run(o, [](Communicator& comm, Rank& r) {
    const int absent = r.size - 1;
    if (r.rank == absent) {
      store_barrier(r.store, "callers done", r.rank, r.size, 10000);
      // Its next op finds it was left out.
      try {
        comm.barrier();
        ADD_FAILURE() << "a rank left out of the group completed a barrier";
      } catch (const mooncake::Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kLeftOut) << e.what();
        EXPECT_EQ(e.peer(), r.rank) << e.what();
        EXPECT_NE(std::string(e.what()).find("left out"), std::string::npos) << e.what();
      }
      return;
    }
    const int64_t start = mooncake::now_us();
    std::vector<int64_t> v(5, int64_t{1} << r.rank);
    comm.all_reduce(v.data(), v.size(), DType::kInt64, RedOp::kSum);
    EXPECT_EQ(v[0], mask_of(all_but(r.size, {absent})));
    const int64_t ms = (mooncake::now_us() - start) / 1000;
    EXPECT_GE(ms, 300);
    EXPECT_LT(ms, 3000);  // 300 ms + a grace of up to 300 ms, with room for a loaded machine
    store_barrier(r.store, "callers done", r.rank, r.size, 10000);
  });
}

TEST_P(Recovery, ARankLateByLessThanATimeoutIsWaitedFor) {
  GroupOptions o = options();
  o.op_timeout_ms = 400;
  run(o, [](Communicator& comm, Rank& r) {
    // The others time out at 400 ms and start a recovery; the late rank comes
    // at 600 ms, learns of it at once and reports in time (before 800 ms).
    if (r.rank == r.size - 1) std::this_thread::sleep_for(std::chrono::milliseconds(600));
    std::vector<int64_t> v(5, int64_t{1} << r.rank);
    comm.all_reduce(v.data(), v.size(), DType::kInt64, RedOp::kSum);
    EXPECT_EQ(v[0], mask_of(all_but(r.size, {})));
    EXPECT_EQ(comm.view().num_members(), r.size);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Recovery,
                         testing::Values(GroupParam{2, false}, GroupParam{3, false},
                                         GroupParam{4, false}, GroupParam{7, false},
                                         GroupParam{3, true}),
                         group_param_name);

// A large all_reduce (reduce-scatter + all-gather, many chunks) whose rank 2
// exits at a fraction of the op's time: the survivors re-run it from their
// inputs, which the first attempt partly overwrote (its own shard in the
// reduce-scatter, everything in the all-gather) and must have kept first.
class KilledInALargeAllReduce : public testing::TestWithParam<int> {};

TEST_P(KilledInALargeAllReduce, TheReRunStartsFromTheInputs) {
  const int percent = GetParam();
  GroupOptions o;
  o.op_timeout_ms = 20000;
  run_group(3, o, [&](Communicator& comm, Rank& r) {
    const size_t count = 60000;  // 480 KB of int64 in 256-byte pieces
    const int64_t mine = int64_t{1} << r.rank;
    std::vector<int64_t> v(count, mine);
    // The op's time when warm (the first pays for first touches): the fastest of three.
    int64_t took_us = INT64_MAX;
    for (int i = 0; i < 3; ++i) {
      std::fill(v.begin(), v.end(), mine);
      const int64_t t0 = mooncake::now_us();
      comm.all_reduce(v.data(), count, DType::kInt64, RedOp::kSum);
      took_us = std::min(took_us, mooncake::now_us() - t0);
      for (int64_t x : v) ASSERT_EQ(x, 7);
    }
    // Every rank arms at the same point: the victim's timer, the others' op.
    store_barrier(r.store, "armed", r.rank, 3);
    if (r.rank == 2) {
      const int64_t delay_us = took_us * percent / 100;
      std::thread([delay_us] {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        ::_exit(0);
      }).detach();
    }
    std::fill(v.begin(), v.end(), mine);
    comm.all_reduce(v.data(), count, DType::kInt64, RedOp::kSum);
    // A victim faster than its timer (a loaded host) completed the op over all
    // three: it waits for the timer, and the survivors check what they got.
    if (r.rank == 2) std::this_thread::sleep_for(std::chrono::seconds(30));
    // Over all three (it completed before the exit) or over the survivors
    // (re-run): every element alike, never a mix.
    ASSERT_TRUE(v[0] == 7 || v[0] == 3) << v[0];
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(v[i], v[0]) << "element " << i;
    store_barrier(r.store, "survivors done", r.rank, 2);
  });
}

INSTANTIATE_TEST_SUITE_P(Fractions, KilledInALargeAllReduce, testing::Values(20, 50, 80),
                         [](const testing::TestParamInfo<int>& info) {
                           return "at" + std::to_string(info.param) + "percent";
                         });

// kill -9 (an abrupt _exit from another thread) at a random moment while every
// rank runs a stream of ops: no survivor hangs, and all survivors agree on the
// set each op covered, op by op.
struct RandomKill {
  int ranks;
  bool tcp;
  int victim;
  uint32_t seed;
};

void PrintTo(const RandomKill& p, std::ostream* os) {
  *os << p.ranks << " ranks over " << (p.tcp ? "tcp" : "shm") << ", victim " << p.victim
      << ", seed " << p.seed;
}

class KilledAtRandom : public testing::TestWithParam<RandomKill> {};

TEST_P(KilledAtRandom, SurvivorsAgreeOpByOp) {
  const RandomKill param = GetParam();
  GroupOptions o;
  o.tcp = param.tcp;
  o.op_timeout_ms = 10000;
  run_group(param.ranks, o, [&](Communicator& comm, Rank& r) {
    if (r.rank == param.victim) {
      std::mt19937 rng(param.seed);
      const int delay_us = static_cast<int>(rng() % 40000);
      std::thread([delay_us] {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        ::_exit(0);
      }).detach();
    }
    // Ops go on until a few rounds after the survivors saw the victim go
    // (they all see it at the same op); the victim is gone within 40 ms.
    const int64_t everyone = mask_of(all_but(r.size, {}));
    std::vector<int64_t> masks;
    int after = -1;
    for (int i = 0; i < 2000 && after < 3; ++i) {
      for (int64_t m : run_every_shape(comm, r.size, i % 2 ? 700 : 3)) {
        masks.push_back(m);
        if (m != everyone && after < 0) after = 0;
      }
      if (after >= 0) ++after;
    }
    ASSERT_NE(r.rank, param.victim) << "the victim outlived the stream of ops";
    ASSERT_GE(after, 0) << "the survivors never saw the victim go";
    const std::vector<int> survivors = all_but(r.size, {param.victim});
    std::string mine;
    for (int64_t m : masks) {
      EXPECT_EQ(m & mask_of(survivors), mask_of(survivors)) << "a survivor missing from an op";
      EXPECT_EQ(m & ~mask_of(all_but(r.size, {})), 0);
      mine += std::to_string(m) + ",";
    }
    r.store.set("masks/" + std::to_string(r.rank), mine);
    for (int p : survivors)
      EXPECT_EQ(r.store.get("masks/" + std::to_string(p), 20000), mine)
          << "rank " << p << " saw other sets than rank " << r.rank;
  });
}

std::vector<RandomKill> random_kills() {
  std::vector<RandomKill> out;
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    out.push_back({3, false, 0, seed});
    out.push_back({4, false, static_cast<int>(seed % 4), seed});
    out.push_back({8, false, static_cast<int>(seed * 3 % 8), seed});
    out.push_back({3, true, static_cast<int>(seed % 3), seed});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Seeds, KilledAtRandom, testing::ValuesIn(random_kills()),
                         [](const testing::TestParamInfo<RandomKill>& info) {
                           const RandomKill& p = info.param;
                           return std::string(p.tcp ? "tcp_" : "shm_") + std::to_string(p.ranks) +
                                  "ranks_victim" + std::to_string(p.victim) + "_seed" +
                                  std::to_string(p.seed);
                         });

}  // namespace
}  // namespace mctest
