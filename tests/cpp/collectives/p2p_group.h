// Helpers for P2P tests: a group whose ranks each run a P2P over the
// communicator's p2p plane, payloads that name their origin, and request checks.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/group.h"
#include "collectives/p2p.h"
#include "collectives/request_error.h"

namespace mctest {

constexpr int64_t kP2PWaitMs = 10000;

// Fails the test unless `req` completes within kP2PWaitMs without an error.
inline void expect_ok(const std::shared_ptr<mooncake::Request>& req, const std::string& what) {
  ASSERT_TRUE(req->wait(kP2PWaitMs)) << what << ": not done after " << kP2PWaitMs << " ms";
  if (auto e = req->error()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      ADD_FAILURE() << what << ": " << ex.what();
    }
  }
}

// `n` ints that name their sender, tag and position.
inline std::vector<int32_t> message(int src, uint64_t tag, size_t n) {
  std::vector<int32_t> m(n);
  for (size_t i = 0; i < n; ++i)
    m[i] = src * 1000000 + static_cast<int>(tag % 1000) * 1000 + static_cast<int>(i % 1000);
  return m;
}

// Runs `body` on each rank of a group with a P2P per rank; the ranks pass a
// barrier before tearing down, so none goes away while a peer still talks to it.
inline void run_p2p(
    int ranks, const GroupOptions& options,
    const std::function<void(mooncake::P2P&, mooncake::Communicator&, Rank&)>& body) {
  run_group(ranks, options, [&](mooncake::Communicator& comm, Rank& r) {
    mooncake::P2P p2p(comm.p2p_channels(), r.rank, r.size, kP2PWaitMs);
    body(p2p, comm, r);
    comm.barrier();
  });
}
inline void run_p2p(
    int ranks, bool tcp,
    const std::function<void(mooncake::P2P&, mooncake::Communicator&, Rank&)>& body) {
  GroupOptions o;
  o.tcp = tcp;
  run_p2p(ranks, o, body);
}

}  // namespace mctest
