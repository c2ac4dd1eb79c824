// Joining goes through two store records: a joiner's waiting/<slot>
// ("<incarnation> <max_world_size>"), which the members read in
// peer_state() and admit(), and admitted/<slot>/<incarnation> (the view
// that takes it in), which the joiner reads in join(). A malformed record
// makes the call that reads it fail with a kInternal Error naming the key,
// on every rank that reads it, at once: no crash, no hang, and the group
// goes on; once the record is right, joining works.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "collectives/group.h"
#include "core/clock.h"
#include "errors.h"

namespace mctest {
namespace {

using mooncake::Communicator;
using mooncake::DType;
using mooncake::ErrorKind;
using mooncake::RedOp;
using mooncake::View;

// `fn` throws kInternal naming `key`, and does so well within `limit_ms`.
testing::AssertionResult fails_at_once(const std::function<void()>& fn, const std::string& key,
                                       int64_t limit_ms = 3000) {
  const int64_t start = mooncake::now_us();
  auto r = throws_error(ErrorKind::kInternal, fn, "under '" + key + "' in the store");
  const int64_t took_ms = (mooncake::now_us() - start) / 1000;
  if (r && took_ms > limit_ms)
    return testing::AssertionFailure() << "it failed, but only after " << took_ms << " ms";
  return r;
}

class MalformedJoinRecords : public testing::TestWithParam<bool> {
 protected:
  GroupOptions options() const {
    GroupOptions o;
    o.tcp = GetParam();
    o.op_timeout_ms = 10000;
    o.limits.timeout_ms = 60000;
    return o;
  }
};

// Members 0 and 1 run a group with room for 3; process 2 waits to join as
// slot 2. Rank 0 spoils waiting/2 in several ways: each time peer_state and
// admit fail on both members, and the group still runs. Then rank 0 puts
// malformed or wrong views under admitted/2/<inc> before anyone admits:
// each time the joiner's join() fails at once. Finally the records are put
// right, the members admit the joiner, and the three run together.
TEST_P(MalformedJoinRecords, FailTheCallThatReadsThemAndTheGroupGoesOn) {
  const GroupOptions o = options();
  const std::vector<std::string> bad_waiting = {
      "",     "x 3",     "1",    "1 3 4",        "1 0",  "1 4194304",
      "-1 3", "1 3\n\n", "1  3", "4294967296 3", "1 3x", "+1 3",
  };
  run_ranks(
      3,
      [&](Rank& r) {
        mooncake::TransferEngine engine = engine_for(o);
        const std::string waiting_key = "g/waiting/2";
        if (r.rank < 2) {
          Communicator comm(engine, r.store, "g/", r.rank, 2, comm_config(o), 3);
          r.store.get("joiner waits", 20000);
          const std::string good = r.store.get(waiting_key, 0);
          EXPECT_EQ(comm.peer_state({2}), std::vector<uint8_t>{1});
          for (size_t i = 0; i < bad_waiting.size(); ++i) {
            const std::string step = std::to_string(i);
            if (r.rank == 0) r.store.set(waiting_key, bad_waiting[i]);
            store_barrier(r.store, "waiting spoilt " + step, r.rank, 2);
            EXPECT_TRUE(fails_at_once([&] { comm.peer_state({2}); }, waiting_key))
                << "waiting record '" << bad_waiting[i] << "'";
            EXPECT_TRUE(fails_at_once([&] { comm.admit({2}); }, waiting_key))
                << "waiting record '" << bad_waiting[i] << "'";
            EXPECT_EQ(member_mask(comm), 0b11) << "after waiting record '" << bad_waiting[i] << "'";
            store_barrier(r.store, "waiting checked " + step, r.rank, 2);
          }
          if (r.rank == 0) r.store.set(waiting_key, good);
          store_barrier(r.store, "waiting restored", r.rank, 2);
          EXPECT_EQ(comm.peer_state({2}), std::vector<uint8_t>{1});

          // The joiner's side: views under its admitted key that no member wrote.
          const std::string inc = good.substr(0, good.find(' '));
          const std::string admitted_key = "g/admitted/2/" + inc;
          View admits = comm.view();
          admits.epoch += 1;
          admits.active[2] = 1;
          admits.incarnation[2] = static_cast<uint32_t>(std::stoul(inc));
          View leaves_out = admits;
          leaves_out.active[2] = 0;
          View other_inc = admits;
          other_inc.incarnation[2] += 1;
          View other_capacity = View::initial(2, 4);
          other_capacity.active[2] = 1;
          other_capacity.incarnation[2] = admits.incarnation[2];
          const std::vector<std::string> bad_admitted = {
              "",
              "garbage",
              admits.encode().substr(0, admits.encode().size() - 3),
              admits.encode() + " 0",
              leaves_out.encode(),
              other_inc.encode(),
              other_capacity.encode(),
          };
          if (r.rank == 0) {
            for (size_t i = 0; i < bad_admitted.size(); ++i) {
              r.store.set(admitted_key, bad_admitted[i]);
              r.store.set("admitted spoilt " + std::to_string(i), "1");
              r.store.get("join checked " + std::to_string(i), 20000);
            }
          } else {
            r.store.get("join checked " + std::to_string(bad_admitted.size() - 1), 30000);
          }
          EXPECT_EQ(member_mask(comm), 0b11);
          store_barrier(r.store, "joiner checked", r.rank, 2);
          r.store.set("admitting/" + std::to_string(r.rank), "1");
          comm.admit({2});  // writes the right view under admitted/2/<inc>, then a barrier
          EXPECT_EQ(member_mask(comm), 0b111);
          EXPECT_EQ(comm.view().members(), (std::vector<int>{0, 1, 2}));
        } else {
          Communicator comm(engine, r.store, "g/", 2, 2, comm_config(o), 3, /*joining=*/true);
          // Its incarnation, as it published it: "<incarnation> <max_world_size>".
          const std::string waiting = r.store.get(waiting_key, 0);
          const std::string admitted_key = "g/admitted/2/" + waiting.substr(0, waiting.find(' '));
          r.store.set("joiner waits", "1");
          for (size_t i = 0; i < 7; ++i) {
            r.store.get("admitted spoilt " + std::to_string(i), 30000);
            EXPECT_TRUE(fails_at_once([&] { comm.join(5000); }, admitted_key)) << "step " << i;
            EXPECT_TRUE(comm.joining());
            r.store.set("join checked " + std::to_string(i), "1");
          }
          // Rank 0 leaves the last spoilt view in place until the members
          // admit this process for real, which overwrites it and then waits
          // for this process in a barrier: join until the right view is there.
          r.store.get("admitting/0", 30000);
          r.store.get("admitting/1", 30000);
          const mooncake::Deadline deadline = mooncake::Deadline::after_ms(30000);
          while (comm.joining() && !deadline.expired()) {
            try {
              comm.join(10000);
            } catch (const mooncake::Error&) {
              std::this_thread::sleep_for(std::chrono::milliseconds(2));
            }
          }
          EXPECT_FALSE(comm.joining());
          EXPECT_EQ(member_mask(comm), 0b111);
          EXPECT_EQ(comm.view().members(), (std::vector<int>{0, 1, 2}));
        }
      },
      o.limits);
}

INSTANTIATE_TEST_SUITE_P(Transports, MalformedJoinRecords, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& info) {
                           return info.param ? "tcp" : "shm";
                         });

}  // namespace
}  // namespace mctest
