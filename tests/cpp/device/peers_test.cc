// Peer cards (device/peers.h): what a process publishes so that peers map its
// segment. No GPU needed: the cards are made by hand.
#include "device/peers.h"

#include <gtest/gtest.h>

namespace mctest {
namespace {

using mooncake::PeerCard;

PeerCard card(char fill, std::string bus, std::string boot = mooncake::boot_id(),
              std::string netns = mooncake::net_namespace()) {
  return PeerCard{std::string(mooncake::kIpcHandleBytes, fill), boot, netns, bus};
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

}  // namespace
}  // namespace mctest
