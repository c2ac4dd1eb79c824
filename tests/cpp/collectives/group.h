// Process groups for collective and p2p tests: N forked ranks, each with a
// Communicator connected through the run's store, over shared memory or over
// forced tcp. Tests are parameterised over world size × transport.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "harness.h"

namespace mctest {

struct GroupParam {
  int ranks;
  bool tcp;
};

inline void PrintTo(const GroupParam& p, std::ostream* os) {
  *os << p.ranks << " ranks over " << (p.tcp ? "tcp" : "shm");
}

// "shm_3ranks", "tcp_2ranks": the suffix of a parameterised test's name.
std::string group_param_name(const testing::TestParamInfo<GroupParam>& info);

// World sizes {1, 2, 3, 4, 7} over shared memory, and a sample of them over tcp.
std::vector<GroupParam> every_world_size();
// A smaller sample, for tests whose point is not the world size.
std::vector<GroupParam> some_world_sizes();

struct GroupOptions {
  bool tcp = false;
  size_t chunk_bytes = 256;  // small, so modest tensors take many chunks
  size_t small_bytes = 512;  // all_reduce/reduce/broadcast above this go two-phase
  int64_t op_timeout_ms = 10000;
  bool recover = true;     // survivors re-run ops a failure interrupted
  int64_t hang_ms = 2000;  // heartbeat silence that counts as a failure
  RunLimits limits = {};
};

// The element counts every op is run with: empty, one, odd, larger than a chunk.
const std::vector<size_t>& sample_counts();

mooncake::CommConfig comm_config(const GroupOptions& options);
mooncake::TransferEngine engine_for(const GroupOptions& options);

// Connects a group of `ranks` processes and runs `body` on each. Checks that
// every peer is served by the transport the options ask for.
// Sum of 1 << rank over the members: the set an all_reduce covered.
int64_t member_mask(mooncake::Communicator& comm);

void run_group(int ranks, const GroupOptions& options,
               const std::function<void(mooncake::Communicator&, Rank&)>& body);

// A parameterised test over GroupParam.
class GroupTest : public testing::TestWithParam<GroupParam> {
 protected:
  GroupOptions options() const {
    GroupOptions o;
    o.tcp = GetParam().tcp;
    return o;
  }
  // Recovery off: failures surface as errors (MOONCAKE_RECOVER=0).
  GroupOptions fail_fast() const {
    GroupOptions o = options();
    o.recover = false;
    return o;
  }
  void run(const std::function<void(mooncake::Communicator&, Rank&)>& body) {
    run_group(GetParam().ranks, options(), body);
  }
  void run(const GroupOptions& o, const std::function<void(mooncake::Communicator&, Rank&)>& body) {
    run_group(GetParam().ranks, o, body);
  }
};

}  // namespace mctest
