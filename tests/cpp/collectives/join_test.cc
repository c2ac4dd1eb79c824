// New processes join a running group: a replacement takes a dead rank's
// slot, an extension fills a slot that was never used, and the group runs at
// full strength again. Joining is two-sided: the process waits in join(),
// the members poll peer_state() and then admit() it.
#include <gtest/gtest.h>

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

// Members poll until a process waits to join as `slot`.
void wait_for_joiner(Communicator& comm, int slot) {
  const mooncake::Deadline deadline = mooncake::Deadline::after_ms(10000);
  while (!comm.peer_state({slot})[0]) {
    ASSERT_FALSE(deadline.expired()) << "no process came to join as rank " << slot;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Members poll until the process for `slot` waits, then admit it.
void admit_when_ready(Communicator& comm, int slot) {
  wait_for_joiner(comm, slot);
  comm.admit({slot});
}

class Join : public testing::TestWithParam<bool> {
 protected:
  GroupOptions options() const {
    GroupOptions o;
    o.tcp = GetParam();
    o.op_timeout_ms = 10000;
    return o;
  }
};

// Processes 0-2 form a group of 3; rank 2 dies; process 3 comes up as its
// replacement. Three cycles of kill and replace, the last one killing rank 0.
TEST_P(Join, AReplacementTakesTheDeadRanksSlotAgainAndAgain) {
  const GroupOptions o = options();
  run_ranks(6, [&](Rank& r) {
    mooncake::TransferEngine engine = engine_for(o);
    // Process p plays: 0,1,2 the first members; 3, 4, 5 the replacements of
    // cycles 1, 2, 3 (for slot 2, 2 and 0).
    const int victims[3] = {2, 2, 0};
    auto run_member = [&](Communicator& comm, int first_cycle) {
      for (int cycle = first_cycle; cycle < 3; ++cycle) {
        const int victim = victims[cycle];
        EXPECT_EQ(member_mask(comm), 0b111) << "cycle " << cycle;
        if (comm.rank() == victim) exit_rank_abruptly();
        EXPECT_EQ(member_mask(comm), 0b111 & ~(1 << victim)) << "cycle " << cycle;
        admit_when_ready(comm, victim);
      }
      EXPECT_EQ(member_mask(comm), 0b111) << "at the end";
      EXPECT_EQ(comm.view().members(), (std::vector<int>{0, 1, 2}));
    };
    if (r.rank < 3) {
      Communicator comm(engine, r.store, "g/", r.rank, 3, comm_config(o));
      run_member(comm, 0);
    } else {
      const int cycle = r.rank - 3;
      // Each replacement starts once the previous cycle's joiner is in.
      if (cycle > 0) r.store.get("joined/" + std::to_string(cycle - 1), 20000);
      Communicator comm(engine, r.store, "g/", victims[cycle], 3, comm_config(o), 3,
                        /*joining=*/true);
      EXPECT_TRUE(comm.joining());
      comm.join();
      r.store.set("joined/" + std::to_string(cycle), "1");
      EXPECT_EQ(comm.view().members(), (std::vector<int>{0, 1, 2}));
      EXPECT_EQ(comm.view().incarnation[victims[cycle]],
                static_cast<uint32_t>(cycle < 2 ? cycle + 1 : 1));
      run_member(comm, cycle + 1);
    }
  });
}

// A group of 2 with room for 4: two new processes fill slots 2 and 3.
TEST_P(Join, ExtensionsFillSlotsThatWereNeverUsed) {
  const GroupOptions o = options();
  run_ranks(4, [&](Rank& r) {
    mooncake::TransferEngine engine = engine_for(o);
    if (r.rank < 2) {
      Communicator comm(engine, r.store, "g/", r.rank, 2, comm_config(o), 4);
      EXPECT_EQ(member_mask(comm), 0b11);
      admit_when_ready(comm, 2);
      EXPECT_EQ(member_mask(comm), 0b111);
      admit_when_ready(comm, 3);
      EXPECT_EQ(member_mask(comm), 0b1111);
    } else {
      if (r.rank == 3) r.store.get("joined/2", 20000);
      Communicator comm(engine, r.store, "g/", r.rank, 2, comm_config(o), 4, true);
      comm.join();
      r.store.set("joined/" + std::to_string(r.rank), "1");
      if (r.rank == 2) {
        EXPECT_EQ(member_mask(comm), 0b111);
        admit_when_ready(comm, 3);  // a member now, it takes part in admitting
      }
      EXPECT_EQ(member_mask(comm), 0b1111);
    }
  });
}

// A joiner that dies after saying it waits, before it is admitted: admit()
// itself finds it gone (the members do not leave that to their next op) and
// the group goes on without it.
TEST_P(Join, AJoinerThatDiesWhileJoiningIsLeftOut) {
  const GroupOptions o = options();
  run_ranks(3, [&](Rank& r) {
    mooncake::TransferEngine engine = engine_for(o);
    if (r.rank < 2) {
      Communicator comm(engine, r.store, "g/", r.rank, 2, comm_config(o), 3);
      admit_when_ready(comm, 2);
      EXPECT_EQ(comm.view().members(), (std::vector<int>{0, 1}));
      EXPECT_EQ(member_mask(comm), 0b11);
    } else {
      Communicator comm(engine, r.store, "g/", 2, 2, comm_config(o), 3, true);
      exit_rank_abruptly();
    }
  });
}

// Wrong requests raise an invalid-argument error on every member and the
// group goes on.
TEST_P(Join, AdmittingWhatCannotJoinIsAnErrorOnEveryMember) {
  const GroupOptions o = options();
  run_ranks(2, [&](Rank& r) {
    mooncake::TransferEngine engine = engine_for(o);
    Communicator comm(engine, r.store, "g/", r.rank, 2, comm_config(o), 3);
    EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [&] { comm.admit({1}); }, "is active"));
    EXPECT_TRUE(
        throws_error(ErrorKind::kInvalidArgument, [&] { comm.admit({3}); }, "max_world_size=3"));
    EXPECT_TRUE(
        throws_error(ErrorKind::kInvalidArgument, [&] { comm.admit({2}); }, "no process waits"));
    EXPECT_TRUE(throws_error(
        ErrorKind::kInvalidArgument, [&] { comm.peer_state({-1}); }, "max_world_size=3"));
    EXPECT_EQ(comm.peer_state({2}), std::vector<uint8_t>{0});
    EXPECT_EQ(member_mask(comm), 0b11);
  });
}

// A joiner created with another capacity (max_world_size) is refused: the
// members get an invalid-argument error naming it, the joiner learns so in
// join() at once, and the members go on; members that disagree on how far the
// group was extended fail alike.
TEST_P(Join, AJoinerWithAnotherCapacityIsRefusedOnBothSides) {
  const GroupOptions o = options();
  run_ranks(3, [&](Rank& r) {
    mooncake::TransferEngine engine = engine_for(o);
    if (r.rank < 2) {
      Communicator comm(engine, r.store, "g/", r.rank, 2, comm_config(o), 3);
      wait_for_joiner(comm, 2);
      EXPECT_TRUE(
          throws_error(ErrorKind::kInvalidArgument, [&] { comm.admit({2}); }, "max_world_size=4"));
      EXPECT_EQ(member_mask(comm), 0b11);
      // Only rank 0 counts slot 2 within the group's size: both members fail,
      // each with its own reason.
      EXPECT_TRUE(throws_error(
          ErrorKind::kInvalidArgument, [&] { comm.admit({2}, -1, false, r.rank == 0 ? 3 : 2); },
          r.rank == 0 ? "max_world_size=4" : "beyond the group's size (2)"));
      EXPECT_EQ(member_mask(comm), 0b11);
      r.store.set("members done/" + std::to_string(r.rank), "1");
    } else {
      Communicator comm(engine, r.store, "g/", 2, 2, comm_config(o), 4, true);
      const int64_t start = mooncake::now_us();
      EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [&] { comm.join(); }, "refused"));
      EXPECT_LT(mooncake::now_us() - start, 5'000'000) << "far sooner than its 10 s timeout";
      r.store.get("members done/0", 20000);
      r.store.get("members done/1", 20000);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Join, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& info) {
                           return info.param ? "tcp" : "shm";
                         });

}  // namespace
}  // namespace mctest
