// Endpoint::connect reads the peer's address record from the store and
// trusts nothing in it: a record that is truncated, garbage, or names
// another slot or incarnation than the key it sits under is a kInternal
// Error naming the key, and installs no link; a record that points at a
// segment that is not the peer's is refused by the seal. Once the record is
// right again, connect works. Two endpoints (ranks 0 and 1) live in this
// one process, over a FileStore in a fresh directory.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/wait.h"
#include "errors.h"
#include "harness.h"
#include "transport/endpoint_group.h"
#include "transport/engine.h"

namespace mctest {
namespace {

using mooncake::Deadline;
using mooncake::Endpoint;
using mooncake::ErrorKind;
using mooncake::PeerAddress;

constexpr size_t kRecordBytes = 8192;
constexpr size_t kRecordFlag = mooncake::kSegmentHeaderBytes;
constexpr size_t kRecordData = kRecordFlag + 64;

class AddressRecord : public TransportTest {
 protected:
  mooncake::EngineOptions options() const {
    mooncake::EngineOptions o = options_for(transport());
    o.host_ip = "127.0.0.1";
    return o;
  }
  TempDir dir_;
  mooncake::FileStore store_{dir_.path() + "/store"};
};

// Writes through `from`'s link to `to` and checks that the bytes land.
void expect_write_lands(Endpoint& from, Endpoint& to, uint64_t round) {
  auto link = from.link(to.rank());
  ASSERT_NE(link, nullptr);
  std::vector<uint8_t> data(256);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(round * 17 + i);
  link->write(kRecordData, data.data(), data.size(), Deadline::after_ms(5000));
  link->signal(kRecordFlag, round, 0, Deadline::after_ms(5000));
  ASSERT_TRUE(mooncake::wait_on(
      to.bell(0), [&] { return mooncake::load_flag(to.base(), kRecordFlag) >= round; },
      Deadline::after_ms(5000)));
  EXPECT_EQ(std::memcmp(to.base() + kRecordData, data.data(), data.size()), 0);
}

TEST_P(AddressRecord, AMalformedRecordIsAnErrorNamingTheKeyAndACorrectOneConnects) {
  mooncake::TransferEngine engine(options());
  Endpoint a(engine, store_, "ep/", 0, 0, 2, kRecordBytes);
  Endpoint b(engine, store_, "ep/", 1, 0, 2, kRecordBytes);
  const std::string key = "ep/addr/1/0";
  const std::string good = store_.get(key, 0);
  const PeerAddress addr = PeerAddress::decode(good);
  ASSERT_EQ(addr.rank, 1);

  PeerAddress other_rank = addr;
  other_rank.rank = 0;
  PeerAddress other_inc = addr;
  other_inc.incarnation = 1;
  struct Case {
    std::string record;
    std::string error;
  };
  const std::vector<Case> cases = {
      {other_rank.encode(),
       "malformed peer address under '" + key + "' in the store: it names rank 0 incarnation 0"},
      {other_inc.encode(),
       "malformed peer address under '" + key + "' in the store: it names rank 1 incarnation 1"},
      {good.substr(0, good.size() / 2),
       "malformed peer address under '" + key + "' in the store: "},
      {good.substr(0, good.find('\n') + 1), "under '" + key + "'"},
      {"", "under '" + key + "' in the store: rank is missing"},
      {"hello", "under '" + key + "' in the store: rank is not a"},
      {good + "extra\n", "under '" + key + "' in the store: the record has"},
  };
  for (const Case& c : cases) {
    store_.set(key, c.record);
    EXPECT_TRUE(throws_error(
        ErrorKind::kInternal, [&] { a.connect(1, 0, Deadline::after_ms(2000)); }, c.error))
        << "record '" << c.record << "'";
    EXPECT_STREQ(a.transport_of(1), "none") << "a link was installed from '" << c.record << "'";
  }

  store_.set(key, good);
  a.connect(1, 0, Deadline::after_ms(5000));
  EXPECT_EQ(a.transport_of(1), transport());
  b.connect(0, 0, Deadline::after_ms(5000));
  expect_write_lands(a, b, 1);
  expect_write_lands(b, a, 2);
}

// A well-formed record for slot 1 that points at slot 2's segment: over shm
// the seal names its owner, and the segment is refused untouched (shm only:
// the seal is the shm transport's).
class ShmAddressRecord : public AddressRecord {};

TEST_P(ShmAddressRecord, ARecordPointingAtAnotherMembersSegmentIsRefused) {
  mooncake::TransferEngine engine(options());
  Endpoint a(engine, store_, "ep/", 0, 0, 3, kRecordBytes);
  Endpoint b(engine, store_, "ep/", 1, 0, 3, kRecordBytes);
  Endpoint c(engine, store_, "ep/", 2, 0, 3, kRecordBytes);
  const std::string key = "ep/addr/1/0";
  const std::string good = store_.get(key, 0);
  PeerAddress forged = PeerAddress::decode(good);
  forged.segment_fd = PeerAddress::decode(store_.get("ep/addr/2/0", 0)).segment_fd;
  store_.set(key, forged.encode());
  const std::vector<uint8_t> before(c.base() + kRecordFlag, c.base() + kRecordBytes);
  EXPECT_TRUE(throws_error(
      ErrorKind::kPeerFailed, [&] { a.connect(1, 0, Deadline::after_ms(2000)); },
      "is not the one rank 1 (incarnation 0) published"));
  EXPECT_STREQ(a.transport_of(1), "none");
  EXPECT_TRUE(std::vector<uint8_t>(c.base() + kRecordFlag, c.base() + kRecordBytes) == before);

  store_.set(key, good);
  a.connect(1, 0, Deadline::after_ms(5000));
  b.connect(0, 0, Deadline::after_ms(5000));
  expect_write_lands(a, b, 1);
}

INSTANTIATE_TEST_SUITE_P(Transports, AddressRecord, testing::ValuesIn(every_transport()),
                         transport_name);
INSTANTIATE_TEST_SUITE_P(Transports, ShmAddressRecord, testing::Values(std::string("shm")),
                         transport_name);

}  // namespace
}  // namespace mctest
