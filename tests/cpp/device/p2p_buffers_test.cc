// P2PBuffers (device/p2p_buffers.h), the device-to-device sends' pool: a
// buffer comes back for reuse when its ack gives it back, a forgotten one is
// never lent again, and a lend never waits. One process: the receiving side
// (open) is the CUDA backend's GPU test (test_cuda_backend.py, device_p2p).
#include "device/p2p_buffers.h"

#include <gtest/gtest.h>

#include "gpu.h"

namespace mctest {
namespace {

using mooncake::P2PBuffers;

TEST(P2PBuffers, ReusesWhatComesBackNeverWhatIsForgotten) {
  MC_REQUIRE_GPU();
  P2PBuffers pool(0);
  const P2PBuffers::Lent a = pool.lend(100);
  const P2PBuffers::Lent b = pool.lend(P2PBuffers::kMinBytes + 1);  // the next size up
  EXPECT_NE(a.ptr, b.ptr);
  EXPECT_NE(a.id, b.id);
  EXPECT_EQ(pool.lent(), 2u);
  pool.give_back(a.id);
  pool.give_back(a.id);  // a second ack of one lending changes nothing
  EXPECT_EQ(pool.lent(), 1u);
  const P2PBuffers::Lent c = pool.lend(P2PBuffers::kMinBytes);
  EXPECT_EQ(c.ptr, a.ptr) << "a buffer that came back is lent again";
  EXPECT_NE(c.id, a.id) << "under a new id (a late ack of the old one must not free it)";
  pool.give_back(a.id);
  EXPECT_EQ(pool.lent(), 2u);
  pool.forget(c.id);
  EXPECT_EQ(pool.lent(), 1u);
  const P2PBuffers::Lent d = pool.lend(P2PBuffers::kMinBytes);
  EXPECT_NE(d.ptr, a.ptr) << "a forgotten buffer (maybe still read) is never lent again";
  pool.give_back(b.id);
  pool.give_back(d.id);
  EXPECT_EQ(pool.lent(), 0u);
}

TEST(P2PBuffers, ALendNeverWaits) {
  MC_REQUIRE_GPU();
  // Past the warning's mark too: a send's caller may be about to post the recv
  // its peer's ack waits for.
  P2PBuffers pool(0);
  const size_t half = P2PBuffers::kWarnLentBytes / 2;
  const P2PBuffers::Lent a = pool.lend(half);
  const P2PBuffers::Lent b = pool.lend(half);
  const P2PBuffers::Lent c = pool.lend(1);
  EXPECT_EQ(pool.lent(), 3u);
  for (const auto& l : {a, b, c}) pool.give_back(l.id);
  EXPECT_EQ(pool.lent(), 0u);
}

}  // namespace
}  // namespace mctest
