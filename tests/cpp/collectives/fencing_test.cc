// Fencing: a rank left out while stopped (SIGSTOP past the hang limit) and
// then resumed writes nothing the group reads. Its next call fails with
// kLeftOut before it writes anything, and what it may still write through the
// mappings it holds (the piece it was copying when it stopped) lands where
// its replacement never writes. Canaries in the survivors' segments check
// both; shared memory only (over tcp a peer's bytes go through its sockets,
// which the survivors close).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "collectives/channel.h"
#include "collectives/group.h"
#include "core/clock.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::ErrorKind;
using mooncake::Layout;
using mooncake::Plane;
using mooncake::RedOp;

constexpr int kSlot = 2;  // the rank that is stopped, then replaced
constexpr uint8_t kCanary = 0xa5;
constexpr uint8_t kScribble = 0x5a;

// Every slot of `src`'s messages, in `region`, on both planes: where a
// process of that incarnation writes in a peer's segment.
std::vector<size_t> slots_of(const Layout& l, int src, int region) {
  std::vector<size_t> out;
  for (Plane plane : {Plane::kCollective, Plane::kP2P})
    for (int s = 0; s < mooncake::kSlotsPerChannel; ++s)
      out.push_back(l.slot(plane, src, s, region));
  return out;
}

// Ops whose every result is known: rank r adds (r + 1) * (i + j) at element j
// of op i, over 3 ranks, so each element must be 6 * (i + j); 1000 elements
// take many pieces of the tests' 256-byte chunks, through both slots.
void checked_traffic(Communicator& comm, int ops) {
  for (int i = 0; i < ops; ++i) {
    std::vector<int64_t> v(1000);
    for (size_t j = 0; j < v.size(); ++j) v[j] = (comm.rank() + 1) * (i + static_cast<int64_t>(j));
    comm.all_reduce(v.data(), v.size(), DType::kInt64, RedOp::kSum);
    for (size_t j = 0; j < v.size(); ++j)
      ASSERT_EQ(v[j], 6 * (i + static_cast<int64_t>(j))) << "op " << i << ", element " << j;
    std::vector<int64_t> b(700, comm.rank() == kSlot ? 7 * i + 1 : -1);
    comm.broadcast(b.data(), b.size(), DType::kInt64, kSlot);
    for (int64_t x : b) ASSERT_EQ(x, 7 * i + 1) << "broadcast " << i;
  }
}

TEST(Fencing, AResumedLeftOutRankWritesNothingTheGroupReads) {
  GroupOptions o;
  o.op_timeout_ms = 20000;
  o.hang_ms = 300;
  // 0 and 1 stay; 2 is stopped, left out and resumed; 3 replaces it.
  run_ranks(
      4,
      [&](Rank& r) {
        mooncake::TransferEngine engine = engine_for(o);
        if (r.rank == 3) {
          r.store.get("left out", 20000);
          Communicator comm(engine, r.store, "g/", kSlot, 3, comm_config(o), 3, /*joining=*/true);
          comm.join();
          EXPECT_EQ(comm.view().incarnation[kSlot], 1u);
          EXPECT_EQ(member_mask(comm), 0b111);
          r.store.get("scribbling", 20000);
          checked_traffic(comm, 300);
          return;
        }
        Communicator comm(engine, r.store, "g/", r.rank, 3, comm_config(o));
        const Layout layout = mooncake::make_layout(3, comm.config().chunk_bytes);
        EXPECT_EQ(member_mask(comm), 0b111);
        if (r.rank == kSlot) {
          // The mappings a process holds while it runs, kept past its fall.
          const std::shared_ptr<mooncake::PeerLink> links[2] = {comm.endpoint().link(0),
                                                                comm.endpoint().link(1)};
          r.store.set("pid", std::to_string(::getpid()));
          ::raise(SIGSTOP);
          // Resumed, with the group gone on without it.
          EXPECT_TRUE(throws_error(ErrorKind::kLeftOut, [&] { comm.barrier(); }, "left out"));
          r.store.set("called", "1");
          // Everything it could still write: its own slots, in every survivor, over and
          // over while the others run (more than the one piece a real resume finishes).
          r.store.get("scribble", 20000);
          std::vector<uint8_t> junk(layout.slot_bytes(), kScribble);
          const mooncake::Deadline forever = mooncake::Deadline::after_ms(60000);
          r.store.set("scribbling", "1");
          int rounds = 0;
          while (!r.store.check({"stop"})) {
            for (const auto& link : links)
              for (size_t at : slots_of(layout, kSlot, mooncake::slot_region(0)))
                link->write(at, junk.data(), junk.size(), forever);
            ++rounds;
          }
          EXPECT_GT(rounds, 0);
          exit_rank_abruptly();
        }
        // The survivors: the stopped rank is left out at the hang limit.
        EXPECT_EQ(member_mask(comm), 0b011);
        if (r.rank == 0) r.store.set("left out", "1");
        const mooncake::Deadline deadline = mooncake::Deadline::after_ms(20000);
        while (!comm.peer_state({kSlot})[0]) {
          ASSERT_FALSE(deadline.expired()) << "no replacement came";
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        comm.admit({kSlot});
        EXPECT_EQ(member_mask(comm), 0b111);
        // Canaries where the old process writes, then it resumes and calls an op.
        uint8_t* base = comm.endpoint().base();
        const std::vector<size_t> old_slots = slots_of(layout, kSlot, mooncake::slot_region(0));
        for (size_t at : old_slots) std::memset(base + at, kCanary, layout.slot_bytes());
        store_barrier(r.store, "canaries", r.rank, 2, 10000);
        if (r.rank == 0) ::kill(std::stoi(r.store.get("pid", 1000)), SIGCONT);
        r.store.get("called", 20000);
        for (size_t at : old_slots)
          for (size_t i = 0; i < layout.slot_bytes(); ++i)
            ASSERT_EQ(base[at + i], kCanary) << "the left-out rank's call wrote at " << at + i;
        // Now it writes all it can while the group runs with its replacement.
        store_barrier(r.store, "checked", r.rank, 2, 10000);
        if (r.rank == 0) r.store.set("scribble", "1");
        r.store.get("scribbling", 20000);
        checked_traffic(comm, 300);
        bool reached = false;  // the test's own check: its writes did land here
        for (size_t at : old_slots) reached = reached || base[at] == kScribble;
        EXPECT_TRUE(reached) << "the left-out rank's writes never reached this segment";
        store_barrier(r.store, "traffic done", r.rank, 2, 10000);
        if (r.rank == 0) r.store.set("stop", "1");
      },
      RunLimits{60000, 3000});
}

}  // namespace
}  // namespace mctest
