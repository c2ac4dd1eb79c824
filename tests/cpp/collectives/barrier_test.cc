// barrier over N processes: no rank leaves a barrier before every rank has
// entered it.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "collectives/group.h"

namespace mctest {
namespace {

using mooncake::Communicator;

class Barrier : public GroupTest {};

TEST_P(Barrier, NoRankLeavesBeforeEveryRankHasEntered) {
  run([](Communicator& comm, Rank& r) {
    for (int round = 0; round < 3; ++round) {
      // A different rank is late each round; it records its arrival last.
      if (r.rank == round % r.size) std::this_thread::sleep_for(std::chrono::milliseconds(30));
      r.store.set("entered/" + std::to_string(round) + "/" + std::to_string(r.rank), "1");
      comm.barrier();
      for (int p = 0; p < r.size; ++p)
        EXPECT_TRUE(r.store.check("entered/" + std::to_string(round) + "/" + std::to_string(p)))
            << "rank " << p << " had not entered barrier " << round;
    }
  });
}

TEST_P(Barrier, ManyBarriersInARowStayInStep) {
  run([](Communicator& comm, Rank&) {
    for (int i = 0; i < 200; ++i) comm.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Barrier, testing::ValuesIn(every_world_size()), group_param_name);

}  // namespace
}  // namespace mctest
