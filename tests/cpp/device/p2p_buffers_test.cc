// P2PBuffers (device/p2p_buffers.h), the device-to-device sends' pool: a
// buffer comes back for reuse when its ack gives it back, a forgotten one is
// never lent again, and past the cap a lend waits (bounded) for buffers to
// come back. One process: the receiving side (open) is the CUDA backend's
// GPU test (test_cuda_backend.py, device_p2p).
#include "device/p2p_buffers.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/error.h"
#include "gpu.h"

namespace mctest {
namespace {

using mooncake::P2PBuffers;

TEST(P2PBuffers, ReusesWhatComesBackNeverWhatIsForgotten) {
  MC_REQUIRE_GPU();
  P2PBuffers pool(0);
  const P2PBuffers::Lent a = pool.lend(100, 1000);
  const P2PBuffers::Lent b = pool.lend(P2PBuffers::kMinBytes + 1, 1000);  // the next size up
  EXPECT_NE(a.ptr, b.ptr);
  EXPECT_NE(a.id, b.id);
  EXPECT_EQ(pool.lent(), 2u);
  pool.give_back(a.id);
  pool.give_back(a.id);  // a second ack of one lending changes nothing
  EXPECT_EQ(pool.lent(), 1u);
  const P2PBuffers::Lent c = pool.lend(P2PBuffers::kMinBytes, 1000);
  EXPECT_EQ(c.ptr, a.ptr) << "a buffer that came back is lent again";
  EXPECT_NE(c.id, a.id) << "under a new id (a late ack of the old one must not free it)";
  pool.give_back(a.id);
  EXPECT_EQ(pool.lent(), 2u);
  pool.forget(c.id);
  EXPECT_EQ(pool.lent(), 1u);
  const P2PBuffers::Lent d = pool.lend(P2PBuffers::kMinBytes, 1000);
  EXPECT_NE(d.ptr, a.ptr) << "a forgotten buffer (maybe still read) is never lent again";
  pool.give_back(b.id);
  pool.give_back(d.id);
  EXPECT_EQ(pool.lent(), 0u);
}

TEST(P2PBuffers, PastTheCapALendWaitsForOneToComeBack) {
  MC_REQUIRE_GPU();
  P2PBuffers pool(0);
  const size_t half = P2PBuffers::kMaxLentBytes / 2;
  const P2PBuffers::Lent a = pool.lend(half, 1000);
  const P2PBuffers::Lent b = pool.lend(half, 1000);
  // Full: a third waits its timeout, then raises, naming the cap.
  const auto start = std::chrono::steady_clock::now();
  try {
    pool.lend(1, 100);
    ADD_FAILURE() << "a lend past the cap did not raise";
  } catch (const mooncake::Error& e) {
    EXPECT_EQ(e.kind(), mooncake::ErrorKind::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("not yet received"), std::string::npos) << e.what();
  }
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(90));
  // One that comes back meanwhile lets a waiting lend through.
  std::thread acker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pool.give_back(a.id);
  });
  const P2PBuffers::Lent c = pool.lend(1, 5000);
  acker.join();
  EXPECT_EQ(pool.lent(), 2u);
  pool.give_back(b.id);
  pool.give_back(c.id);
  EXPECT_EQ(pool.lent(), 0u);
}

}  // namespace
}  // namespace mctest
