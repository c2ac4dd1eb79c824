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

// Slots 0 and 1 of a group of 2 with room for 4, and slot 3 joined past the
// world size. Per-rank arrays as wide as the capacity address slot 3 (slot 2,
// never used, is zero-filled or ignored); arrays of the world size's width
// fail on every rank, naming the member past them, and the group goes on.
TEST_P(Join, PerRankArraysReachRanksThatJoinedPastTheWorldSize) {
  const GroupOptions o = options();
  run_ranks(3, [&](Rank& r) {
    mooncake::TransferEngine engine = engine_for(o);
    const int slot = r.rank < 2 ? r.rank : 3;
    Communicator comm(engine, r.store, "g/", slot, 2, comm_config(o), 4, r.rank == 2);
    if (r.rank < 2)
      admit_when_ready(comm, 3);
    else
      comm.join();
    ASSERT_EQ(member_mask(comm), 0b1011);
    const std::vector<int> members{0, 1, 3};
    auto is_member = [&](int p) { return p != 2; };

    // all_gather: outs[p] gets slot p's pair.
    const int32_t mine[2] = {10 * slot, 10 * slot + 1};
    std::vector<int32_t> got(8, -1);
    std::vector<void*> outs;
    for (int p = 0; p < 4; ++p) outs.push_back(&got[2 * p]);
    comm.all_gather(mine, 2, DType::kInt32, outs.data(), -1, 4);
    for (int p = 0; p < 4; ++p) {
      EXPECT_EQ(got[2 * p], is_member(p) ? 10 * p : 0) << "all_gather from " << p;
      EXPECT_EQ(got[2 * p + 1], is_member(p) ? 10 * p + 1 : 0) << "all_gather from " << p;
    }

    // all_to_all: slot s sends 100 * s + p to slot p.
    std::vector<int32_t> send(4), recv(4, -1);
    std::vector<const void*> ins;
    std::vector<void*> outs2;
    const std::vector<size_t> ones(4, 1);
    for (int p = 0; p < 4; ++p) {
      send[p] = 100 * slot + p;
      ins.push_back(&send[p]);
      outs2.push_back(&recv[p]);
    }
    comm.all_to_all(ins.data(), ones.data(), outs2.data(), ones.data(), DType::kInt32, -1, 4);
    for (int p = 0; p < 4; ++p)
      EXPECT_EQ(recv[p], is_member(p) ? 100 * p + slot : 0) << "all_to_all from " << p;

    // reduce_scatter: slot p's shard is the sum over members of 1000 * p + s.
    std::vector<int32_t> shards(4);
    std::vector<const void*> shard_ptrs;
    for (int p = 0; p < 4; ++p) {
      shards[p] = 1000 * p + slot;
      shard_ptrs.push_back(&shards[p]);
    }
    int32_t reduced = -1;
    comm.reduce_scatter(shard_ptrs.data(), &reduced, 1, DType::kInt32, RedOp::kSum, -1, 4);
    EXPECT_EQ(reduced, 3 * 1000 * slot + (0 + 1 + 3));

    // gather to and scatter from slot 3, the joiner (only the root's arrays matter).
    std::vector<int32_t> gathered(4, -1);
    std::vector<void*> gather_outs;
    for (int p = 0; p < 4; ++p) gather_outs.push_back(&gathered[p]);
    const int32_t one = 7 * slot;
    comm.gather(&one, 1, DType::kInt32, gather_outs.data(), 3, -1, slot == 3 ? 4 : 0);
    if (slot == 3)
      for (int p = 0; p < 4; ++p) EXPECT_EQ(gathered[p], is_member(p) ? 7 * p : 0);
    std::vector<int32_t> parts{50, 51, 52, 53};
    std::vector<const void*> part_ptrs;
    for (auto& v : parts) part_ptrs.push_back(&v);
    int32_t part = -1;
    comm.scatter(part_ptrs.data(), &part, 1, DType::kInt32, 3, -1, slot == 3 ? 4 : 0);
    EXPECT_EQ(part, 50 + slot);

    // The world size's width cannot hold slot 3: every rank fails, naming it.
    std::vector<int32_t> narrow(4, -1);
    std::vector<void*> narrow_outs{&narrow[0], &narrow[2]};
    EXPECT_TRUE(throws_error(
        ErrorKind::kInvalidArgument,
        [&] { comm.all_gather(mine, 2, DType::kInt32, narrow_outs.data()); },
        "rank 3 is a member, but this rank's per-rank tensor lists have only 2 entries"));
    int32_t sum = slot;
    comm.all_reduce(&sum, 1, DType::kInt32, RedOp::kSum);
    EXPECT_EQ(sum, 0 + 1 + 3) << "the group goes on";
    EXPECT_EQ(comm.view().members(), members);
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Join, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& info) {
                           return info.param ? "tcp" : "shm";
                         });

}  // namespace
}  // namespace mctest
