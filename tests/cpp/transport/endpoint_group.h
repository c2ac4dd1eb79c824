// Endpoints for transport tests: each rank of a run connects one Endpoint to
// every other rank, over shared memory or over forced tcp.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "harness.h"
#include "transport/engine.h"

namespace mctest {

inline std::unique_ptr<mooncake::Endpoint> connect_endpoint(Rank& r, bool tcp,
                                                            size_t segment_bytes) {
  mooncake::EngineOptions options;
  options.force_tcp = tcp;
  mooncake::TransferEngine engine(options);
  auto ep = std::make_unique<mooncake::Endpoint>(engine, r.store, "ep/", r.rank, 0, r.size,
                                                 segment_bytes);
  ep->connect_all(r.size, mooncake::Deadline::after_ms(10000));
  return ep;
}

// A test parameterised over the transport.
class TransportTest : public testing::TestWithParam<bool> {
 protected:
  bool tcp() const { return GetParam(); }
};

inline std::string transport_name(const testing::TestParamInfo<bool>& info) {
  return info.param ? "tcp" : "shm";
}

}  // namespace mctest
