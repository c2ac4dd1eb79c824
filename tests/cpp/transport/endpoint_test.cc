// Endpoint and engine: peers on this host are reached through shared memory
// unless tcp is forced, a rank reaches itself directly, addresses survive
// the store, ranks that disagree on the segment size cannot connect, and
// MOONCAKE_TRANSPORT is validated; links that map the peer's memory hand it
// over; a peer's hint words only grow, each on its own.
#include <gtest/gtest.h>

#include <fstream>

#include "core/wait.h"
#include "errors.h"
#include "scoped_env.h"
#include "transport/endpoint_group.h"
#include "transport/engine.h"

namespace mctest {
namespace {

using mooncake::EngineOptions;
using mooncake::ErrorKind;
using mooncake::PeerAddress;

class EndpointTransport : public TransportTest {};

TEST_P(EndpointTransport, PeersUseTheChosenTransportAndARankReachesItselfDirectly) {
  run_ranks(3, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    EXPECT_EQ(ep->rank(), r.rank);
    EXPECT_EQ(ep->capacity(), r.size);
    for (int peer = 0; peer < r.size; ++peer)
      EXPECT_EQ(ep->transport_of(peer), peer == r.rank ? "self" : transport()) << "peer " << peer;
    store_barrier(r.store, "checked", r.rank, r.size);
  });
}

// shm and self hand the data plane the peer's segment: bytes stored through
// the mapping are what the peer finds in its own segment once signalled; tcp
// only moves bytes and hands no mapping.
TEST_P(EndpointTransport, MappingLinksHandOverThePeersSegment) {
  constexpr size_t kBytes = 8192, kFlag = mooncake::kSegmentHeaderBytes, kData = kFlag + 64;
  run_ranks(2, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), kBytes);
    const mooncake::PeerSpan self = ep->link(r.rank)->mapping();
    EXPECT_EQ(self.data, ep->base());
    EXPECT_EQ(self.bytes, ep->segment_bytes());
    const mooncake::PeerSpan peer = ep->link(1 - r.rank)->mapping();
    if (network()) {
      EXPECT_EQ(peer.data, nullptr);
      EXPECT_EQ(peer.bytes, 0u);
    } else {
      ASSERT_NE(peer.data, nullptr);
      EXPECT_EQ(peer.bytes, ep->segment_bytes());
      EXPECT_NE(peer.data, ep->base());  // the peer's memory, not this rank's
      for (size_t i = 0; i < 64; ++i) peer.data[kData + i] = static_cast<uint8_t>(r.rank * 64 + i);
      ep->link(1 - r.rank)->signal(kFlag, 1, 0, mooncake::Deadline::after_ms(5000));
      ASSERT_TRUE(mooncake::wait_on(
          ep->bell(0), [&] { return mooncake::load_flag(ep->base(), kFlag) >= 1; },
          mooncake::Deadline::after_ms(5000), nullptr, 50));
      for (size_t i = 0; i < 64; ++i)
        ASSERT_EQ(ep->base()[kData + i], static_cast<uint8_t>((1 - r.rank) * 64 + i)) << i;
    }
    store_barrier(r.store, "mapped", r.rank, r.size);
  });
}

// Hint words are raised by peers and never lowered (a stale writer cannot
// undo a newer hint); each slot is its own word, and a post wakes a waiter.
TEST_P(EndpointTransport, HintWordsOnlyGrowEachOnItsOwn) {
  static_assert(mooncake::kNumHints >= 2);
  run_ranks(2, [this](Rank& r) {
    auto ep = connect_endpoint(r, transport(), 4096);
    if (r.rank == 0) {
      ep->post_hint(1, 0, 5);
      ep->post_hint(1, 0, 3);  // lower: ignored
      ep->post_hint(1, 1, 9);
      EXPECT_EQ(ep->hint(0), 0u);  // its own: nobody posted to it
      EXPECT_EQ(ep->hint(1), 0u);
    } else {
      // The posts arrive in order, so once slot 1 holds 9 slot 0 has seen both.
      ASSERT_TRUE(mooncake::wait_on(
          ep->bell(0), [&] { return ep->hint(1) == 9; }, mooncake::Deadline::after_ms(5000),
          nullptr, 50));
      EXPECT_EQ(ep->hint(0), 5u);
      ep->post_hint(1, 1, 4);  // to itself, lower: ignored
      EXPECT_EQ(ep->hint(1), 9u);
    }
    store_barrier(r.store, "hinted", r.rank, r.size);
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, EndpointTransport, testing::ValuesIn(every_transport()),
                         transport_name);

TEST(Endpoint, RanksThatDisagreeOnTheSegmentSizeCannotConnect) {
  run_ranks(2, [](Rank& r) {
    EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument,
                             [&] { connect_endpoint(r, "shm", r.rank == 0 ? 4096 : 8192); }));
  });
}

TEST(PeerAddress, EncodeDecodeRoundTrips) {
  PeerAddress a;
  a.rank = 6;
  a.host_key = mooncake::local_host_key();
  a.pid = 4242;
  a.segment_fd = 17;
  a.segment_bytes = uint64_t{1} << 40;
  a.tcp_host = "10.1.2.3";
  a.tcp_port = 65000;
  EXPECT_TRUE(PeerAddress::decode(a.encode()) == a) << a.encode();
}

TEST(PeerAddress, ATruncatedAddressIsAnError) {
  PeerAddress a;
  a.rank = 1;
  std::string text = a.encode();
  text.resize(text.size() / 2);
  EXPECT_THROW(PeerAddress::decode(text), mooncake::Error);
}

TEST(HostKey, IsStableAndNamesThisBoot) {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(in, boot_id);
  EXPECT_EQ(mooncake::local_host_key(), mooncake::local_host_key());
  EXPECT_EQ(mooncake::local_host_key().rfind(boot_id, 0), 0u) << mooncake::local_host_key();
}

TEST(EngineOptions, TransportComesFromTheEnvironment) {
  {
    ScopedEnv t("MOONCAKE_TRANSPORT", "tcp");
    EXPECT_TRUE(EngineOptions::from_env().force_tcp);
  }
  for (const char* v : {"auto", "shm"}) {
    ScopedEnv t("MOONCAKE_TRANSPORT", v);
    EXPECT_FALSE(EngineOptions::from_env().force_tcp) << v;
  }
  {
    ScopedEnv t("MOONCAKE_TRANSPORT", "ucx");
    EXPECT_TRUE(EngineOptions::from_env().force_ucx);
    EXPECT_FALSE(EngineOptions::from_env().force_tcp);
  }
  {
    ScopedEnv t("MOONCAKE_TRANSPORT", "verbs");
    EXPECT_TRUE(throws_error(
        ErrorKind::kInvalidArgument, [] { EngineOptions::from_env(); },
        "MOONCAKE_TRANSPORT must be auto, shm, tcp or ucx, got 'verbs'"));
  }
  ScopedEnv unset("MOONCAKE_TRANSPORT", std::nullopt);
  EXPECT_FALSE(EngineOptions::from_env().force_tcp);
  EXPECT_FALSE(EngineOptions::from_env().force_ucx);
}

// Without an RDMA device, auto mode keeps to shm and tcp; forcing ucx works
// where the build has it and is a clear error where it does not.
TEST(EngineOptions, UcxIsUsedWhenForcedOrWithAnRdmaDevice) {
  EngineOptions o;
  EXPECT_EQ(o.wants_ucx(), mooncake::ucx_built() && !mooncake::rdma_devices().empty());
  o.force_ucx = true;
  if (mooncake::ucx_built()) {
    EXPECT_TRUE(o.wants_ucx());
    o.force_tcp = true;
    EXPECT_FALSE(o.wants_ucx());
  } else {
    EXPECT_TRUE(throws_error(
        ErrorKind::kInvalidArgument, [&] { (void)o.wants_ucx(); },
        "MOONCAKE_TRANSPORT=ucx: the ucx transport is not in this build"));
  }
}

TEST(EngineOptions, AnUnknownTransportIsAnInvalidArgument) {
  ScopedEnv t("MOONCAKE_TRANSPORT", "rdma-please");
  EXPECT_TRUE(throws_error(ErrorKind::kInvalidArgument, [] { EngineOptions::from_env(); }));
}

TEST(EngineOptions, HostIpComesFromTheEnvironment) {
  ScopedEnv ip("MOONCAKE_HOST_IP", "127.0.0.1");
  EXPECT_EQ(EngineOptions::from_env().host_ip, "127.0.0.1");
}

TEST(TransferEngine, OffersSharedMemoryAndTcp) {
  auto t = mooncake::TransferEngine::available_transports();
  EXPECT_NE(std::find(t.begin(), t.end(), "shm"), t.end());
  EXPECT_NE(std::find(t.begin(), t.end(), "tcp"), t.end());
}

}  // namespace
}  // namespace mctest
