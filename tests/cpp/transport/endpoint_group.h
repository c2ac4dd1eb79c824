// Endpoints for transport tests: each rank of a run connects one Endpoint to
// every other rank, over shared memory, forced tcp or forced ucx (where the
// build has it).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "transport/engine.h"

namespace mctest {

// Options that pick `transport` ("shm", "tcp" or "ucx") for every peer.
inline mooncake::EngineOptions options_for(const std::string& transport) {
  mooncake::EngineOptions o;
  o.force_tcp = transport == "tcp";
  o.force_ucx = transport == "ucx";
  return o;
}

inline std::unique_ptr<mooncake::Endpoint> connect_endpoint(Rank& r, const std::string& transport,
                                                            size_t segment_bytes) {
  mooncake::EngineOptions options = options_for(transport);
  mooncake::TransferEngine engine(options);
  auto ep = std::make_unique<mooncake::Endpoint>(engine, r.store, "ep/", r.rank, 0, r.size,
                                                 segment_bytes);
  ep->connect_all(r.size, mooncake::Deadline::after_ms(10000));
  return ep;
}

// A test parameterised over the transport.
class TransportTest : public testing::TestWithParam<std::string> {
 protected:
  const std::string& transport() const { return GetParam(); }
  // Whether the transport maps the peer's memory (shm) or moves bytes.
  bool network() const { return GetParam() != "shm"; }
};

// shm, tcp, and ucx where this build has it.
inline std::vector<std::string> every_transport() {
  std::vector<std::string> out = {"shm", "tcp"};
  if (mooncake::ucx_built()) out.push_back("ucx");
  return out;
}

inline std::string transport_name(const testing::TestParamInfo<std::string>& info) {
  return info.param;
}

}  // namespace mctest
