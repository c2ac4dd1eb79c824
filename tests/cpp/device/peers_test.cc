// Peer cards (device/peers.h): what a process publishes so that peers map its
// segment. No GPU needed: the cards are made by hand.
#include "device/peers.h"

#include <gtest/gtest.h>

namespace mctest {
namespace {

using mooncake::PeerCard;

PeerCard card(char fill, std::string bus, std::string boot = mooncake::boot_id(),
              std::string netns = mooncake::net_namespace(),
              std::string pidns = mooncake::pid_namespace()) {
  return PeerCard{std::string(mooncake::kIpcHandleBytes, fill),         boot, netns, bus, pidns,
                  mooncake::LifeRef{4242, 17, 0x1234'5678'9abc'def1ull}};
}

TEST(PeerCard, RoundTripsAtAFixedSize) {
  const PeerCard c = card('\x7f', "0000:1b:00.0");
  const std::string bytes = c.encode();
  ASSERT_EQ(bytes.size(), PeerCard::kBytes);
  const auto back = PeerCard::decode(bytes);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->handle, c.handle);
  EXPECT_EQ(back->boot, c.boot);
  EXPECT_EQ(back->netns, c.netns);
  EXPECT_EQ(back->bus_id, c.bus_id);
  EXPECT_EQ(back->pidns, c.pidns);
  EXPECT_EQ(back->life, c.life);
}

TEST(PeerCard, AnythingButACardDecodesAsAbsent) {
  EXPECT_FALSE(PeerCard::decode(std::string(PeerCard::kBytes, '\0')));  // an absent rank's zeros
  EXPECT_FALSE(PeerCard::decode(""));
  std::string bytes = card('a', "bus").encode();
  EXPECT_FALSE(PeerCard::decode(bytes.substr(0, PeerCard::kBytes - 1)));
  bytes[mooncake::kIpcHandleBytes + 1] = static_cast<char>(200);  // a field longer than its room
  EXPECT_FALSE(PeerCard::decode(bytes));
}

TEST(PeerCard, SameHostNeedsTheBootIdAndTheNetworkNamespace) {
  EXPECT_TRUE(card('a', "bus").on_this_host());
  EXPECT_FALSE(card('a', "bus", "another-boot").on_this_host());
  EXPECT_FALSE(card('a', "bus", mooncake::boot_id(), "net:[1]").on_this_host());
  EXPECT_EQ(mooncake::host_identity(), mooncake::boot_id() + "/" + mooncake::net_namespace());
}

// A life page is named by pid and fd: only a process of the same host and pid
// namespace may open it.
TEST(PeerCard, ALifePageIsMappedOnlyFromTheSameHostAndPidNamespace) {
  EXPECT_EQ(card('a', "bus").life_here(), card('a', "bus").life);
  EXPECT_FALSE(card('a', "bus", "another-boot").life_here().valid());
  EXPECT_FALSE(card('a', "bus", mooncake::boot_id(), "net:[1]").life_here().valid());
  EXPECT_FALSE(card('a', "bus", mooncake::boot_id(), mooncake::net_namespace(), "pid:[1]")
                   .life_here()
                   .valid());
  PeerCard none = card('a', "bus");
  none.life = {};
  EXPECT_FALSE(PeerCard::decode(none.encode())->life.valid());
}

TEST(PeerCard, GpuSharersCountOneMachineAndBusIdAcrossNamespaces) {
  const PeerCard mine = card('m', "gpu0");
  std::vector<std::optional<PeerCard>> cards = {
      mine,
      card('a', "gpu0"),
      card('b', "gpu0", mooncake::boot_id(), "net:[1]"),  // another namespace, the same GPU
      card('c', "gpu1"),
      card('d', "gpu0", "another-boot"),
      std::nullopt,
  };
  EXPECT_EQ(mooncake::gpu_sharers(mine, cards), 3);
  cards.erase(cards.begin());  // mine counts once, listed or not
  EXPECT_EQ(mooncake::gpu_sharers(mine, cards), 3);
  EXPECT_EQ(mooncake::gpu_sharers(mine, {}), 1);
}

TEST(GpuRecord, RoundTrips) {
  using mooncake::GpuRecord;
  for (const GpuRecord& r : {GpuRecord{"boot/net:[1]", "0000:1b:00.0", {}},
                             GpuRecord{"h", "0000:1b:00.0", {"0000:2c:00.0", "0000:9d:00.0"}}}) {
    const auto back = GpuRecord::decode(r.encode());
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(back->host, r.host);
    EXPECT_EQ(back->bus_id, r.bus_id);
    EXPECT_EQ(back->reaches, r.reaches);
  }
  EXPECT_FALSE(GpuRecord::decode(""));
  EXPECT_FALSE(GpuRecord::decode("host only"));
  EXPECT_FALSE(GpuRecord::decode("a\nb\nc\nd"));
}

std::optional<mooncake::GpuRecord> gpu(std::string bus, std::vector<std::string> reaches,
                                       std::string host = "h") {
  return mooncake::GpuRecord{std::move(host), std::move(bus), std::move(reaches)};
}

TEST(JudgeReach, OneGpuAndGpusWithPeerAccessBothWaysMap) {
  const auto one = mooncake::judge_reach({gpu("g0", {}), gpu("g0", {}), gpu("g0", {})}, 1);
  EXPECT_TRUE(one.mappable());
  EXPECT_EQ(one.gpu_sharers, 3);
  // Two GPUs, two ranks each (rank r on GPU r % 2), and a third GPU no rank uses.
  const auto a = gpu("g0", {"g1"}), b = gpu("g1", {"g0", "g2"});
  const auto two = mooncake::judge_reach({a, b, a, b}, 3);
  EXPECT_TRUE(two.mappable()) << two.no_peer_access;
  EXPECT_EQ(two.gpu_sharers, 2);
}

TEST(JudgeReach, APairWithoutPeerAccessEitherWayNamesItAlikeOnEveryRank) {
  // g1 reaches g0 but not the other way: rank 0 could not map rank 1's segment.
  const std::vector<std::optional<mooncake::GpuRecord>> records = {gpu("g0", {}), gpu("g1", {"g0"}),
                                                                   gpu("g0", {})};
  const auto r0 = mooncake::judge_reach(records, 0);
  EXPECT_TRUE(r0.same_host);
  EXPECT_FALSE(r0.mappable());
  EXPECT_NE(r0.no_peer_access.find("rank 0's GPU (g0) has no peer access to rank 1's GPU (g1)"),
            std::string::npos)
      << r0.no_peer_access;
  EXPECT_EQ(mooncake::judge_reach(records, 1).no_peer_access, r0.no_peer_access);
  EXPECT_EQ(r0.gpu_sharers, 2);
  // The other way round names the other rank.
  const auto r1 = mooncake::judge_reach({gpu("g0", {"g1"}), gpu("g1", {})}, 0);
  EXPECT_NE(r1.no_peer_access.find("rank 1's GPU (g1) has no peer access to rank 0's"),
            std::string::npos)
      << r1.no_peer_access;
}

TEST(JudgeReach, AnotherHostOrAMissingRecordIsNotOneHost) {
  const auto other = mooncake::judge_reach({gpu("g0", {}), gpu("g0", {}, "elsewhere")}, 0);
  EXPECT_FALSE(other.same_host);
  EXPECT_FALSE(other.mappable());
  EXPECT_TRUE(other.no_peer_access.empty());  // not a peer-access problem: no warning
  EXPECT_FALSE(mooncake::judge_reach({gpu("g0", {}), std::nullopt}, 0).mappable());
}

}  // namespace
}  // namespace mctest
