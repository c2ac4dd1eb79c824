#include "collectives/group.h"

#include <cstring>

namespace mctest {

std::string group_param_name(const testing::TestParamInfo<GroupParam>& info) {
  return std::string(info.param.tcp ? "tcp_" : "shm_") + std::to_string(info.param.ranks) + "ranks";
}

std::vector<GroupParam> every_world_size() {
  return {{1, false}, {2, false}, {3, false}, {4, false}, {7, false}, {2, true}, {3, true}};
}

std::vector<GroupParam> some_world_sizes() {
  return {{2, false}, {3, false}, {7, false}, {3, true}};
}

const std::vector<size_t>& sample_counts() {
  static const std::vector<size_t> counts = {0, 1, 33, 1001};
  return counts;
}

mooncake::CommConfig comm_config(const GroupOptions& options) {
  mooncake::CommConfig config;
  config.timeout_ms = options.op_timeout_ms;
  config.chunk_bytes = options.chunk_bytes;
  config.small_bytes = options.small_bytes;
  config.recover = options.recover ? 1 : 0;
  config.hang_ms = options.hang_ms;
  return config;
}

mooncake::TransferEngine engine_for(const GroupOptions& options) {
  mooncake::EngineOptions engine_options;
  engine_options.force_tcp = options.tcp;
  return mooncake::TransferEngine(engine_options);
}

void run_group(int ranks, const GroupOptions& options,
               const std::function<void(mooncake::Communicator&, Rank&)>& body) {
  run_ranks(
      ranks,
      [&](Rank& r) {
        mooncake::TransferEngine engine = engine_for(options);
        mooncake::Communicator comm(engine, r.store, "group/", r.rank, r.size,
                                    comm_config(options));
        for (int peer = 0; peer < r.size; ++peer) {
          const char* want = peer == r.rank ? "self" : options.tcp ? "tcp" : "shm";
          ASSERT_STREQ(comm.transport_of(peer), want) << "peer " << peer;
        }
        body(comm, r);
      },
      options.limits);
}

int64_t member_mask(mooncake::Communicator& comm) {
  int64_t v = int64_t{1} << comm.rank();
  comm.all_reduce(&v, 1, mooncake::DType::kInt64, mooncake::RedOp::kSum);
  return v;
}

}  // namespace mctest
