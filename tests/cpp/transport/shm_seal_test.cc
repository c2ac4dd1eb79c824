// The shm seal: shm_seal writes the owner's slot, incarnation, a nonce and a
// SipHash seal keyed with the group's secret into the segment header;
// shm_connect maps /proc/<pid>/fd/<fd> and refuses (kPeerFailed), before it
// writes a byte, anything that is not a regular file of the published size
// whose header names the published slot and incarnation under the group's
// seal. Everything runs in this one process: a segment's fd is reachable at
// /proc/<our pid>/fd/<fd>.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "errors.h"
#include "harness.h"
#include "transport/engine.h"
#include "transport/link.h"
#include "transport/segment.h"
#include "transport/shm.h"
#include "transport/tcp.h"

namespace mctest {
namespace {

using mooncake::Deadline;
using mooncake::ErrorKind;
using mooncake::PeerAddress;
using mooncake::Segment;
using mooncake::SegmentHeader;

constexpr size_t kSealBytes = 1 << 16;

// The address a rank publishes for `segment` in this process.
PeerAddress address_of(const Segment& segment, int rank, uint32_t inc) {
  PeerAddress a;
  a.rank = rank;
  a.incarnation = inc;
  a.host_key = mooncake::local_host_key();
  a.pid = static_cast<int>(::getpid());
  a.segment_fd = segment.fd();
  a.segment_bytes = segment.size();
  a.tcp_host = "127.0.0.1";
  a.tcp_port = 1;
  return a;
}

std::vector<uint8_t> bytes_of(const Segment& s) {
  return std::vector<uint8_t>(s.base(), s.base() + s.size());
}

// Fills the segment past its header with a recognisable pattern.
void fill(Segment& s) {
  for (size_t i = mooncake::kSegmentHeaderBytes; i < s.size(); ++i)
    s.base()[i] = static_cast<uint8_t>(i * 31 + 7);
}

// shm_connect(addr, secret) must be refused as a peer failure, and leave
// `target` exactly as it was.
void expect_refused(const PeerAddress& addr, const std::string& secret, const Segment& target,
                    const std::string& contains = "") {
  const std::vector<uint8_t> before = bytes_of(target);
  EXPECT_TRUE(
      throws_error(ErrorKind::kPeerFailed, [&] { mooncake::shm_connect(addr, secret); }, contains));
  EXPECT_TRUE(bytes_of(target) == before) << "the refused segment was changed";
}

class ShmSeal : public testing::Test {
 protected:
  void SetUp() override {
    fill(target_);
    mooncake::shm_seal(target_, me_, secret_);
  }
  const std::string secret_ = mooncake::random_secret();
  Segment target_{kSealBytes};
  const PeerAddress me_ = address_of(target_, 3, 2);
};

TEST_F(ShmSeal, SealingWritesTheOwnerIntoTheHeader) {
  const auto& h = *reinterpret_cast<const SegmentHeader*>(target_.base());
  EXPECT_EQ(h.owner_rank, 3u);
  EXPECT_EQ(h.owner_incarnation, 2u);
  EXPECT_NE(h.seal, 0u);
  // The nonce is fresh per sealing: the same owner sealed again gets
  // another nonce and so another seal.
  Segment other(kSealBytes);
  mooncake::shm_seal(other, address_of(other, 3, 2), secret_);
  const auto& o = *reinterpret_cast<const SegmentHeader*>(other.base());
  EXPECT_NE(o.nonce, h.nonce);
  EXPECT_NE(o.seal, h.seal);
}

TEST_F(ShmSeal, ASealedSegmentConnectsWithTheGroupsSecretAndAWriteLands) {
  auto link = mooncake::shm_connect(me_, secret_);
  ASSERT_NE(link, nullptr);
  EXPECT_STREQ(link->transport(), "shm");
  EXPECT_TRUE(link->alive());
  std::vector<uint8_t> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(255 - i % 251);
  std::vector<uint8_t> expected = bytes_of(target_);
  std::memcpy(expected.data() + 4096, data.data(), data.size());
  link->write(4096, data.data(), data.size(), Deadline::after_ms(1000));
  EXPECT_TRUE(bytes_of(target_) == expected) << "the write did not land exactly";
  link->signal(kSealBytes - 8, 0x1122334455667788ull, 1, Deadline::after_ms(1000));
  EXPECT_EQ(mooncake::load_flag(target_.base(), kSealBytes - 8), 0x1122334455667788ull);
}

TEST_F(ShmSeal, AnotherSecretIsRefused) {
  std::string other = mooncake::random_secret();
  ASSERT_NE(other, secret_);
  expect_refused(me_, other, target_, "is not the one rank 3 (incarnation 2) published");
  // One hex digit off is enough.
  other = secret_;
  other[31] = other[31] == '0' ? '1' : '0';
  expect_refused(me_, other, target_);
  other = secret_;
  other[0] = other[0] == 'f' ? 'e' : 'f';
  expect_refused(me_, other, target_);
}

TEST_F(ShmSeal, AnotherIncarnationIsRefused) {
  for (uint32_t inc : {0u, 1u, 3u, 0xffffffffu}) {
    PeerAddress addr = me_;
    addr.incarnation = inc;
    expect_refused(addr, secret_, target_, "incarnation " + std::to_string(inc));
  }
}

TEST_F(ShmSeal, AnotherRankIsRefused) {
  for (int rank : {0, 2, 4, 1000}) {
    PeerAddress addr = me_;
    addr.rank = rank;
    expect_refused(addr, secret_, target_, "rank " + std::to_string(rank));
  }
}

// The seal covers the pid and size the owner published, not only the slot:
// a header sealed for another pid or size does not pass for this one.
TEST_F(ShmSeal, ASealForAnotherPidOrSizeIsRefused) {
  Segment s(kSealBytes);
  PeerAddress claimed = address_of(s, 1, 0);
  claimed.pid = 1;  // sealed as if it belonged to another process
  mooncake::shm_seal(s, claimed, secret_);
  expect_refused(address_of(s, 1, 0), secret_, s);

  Segment t(kSealBytes);
  claimed = address_of(t, 1, 0);
  claimed.segment_bytes = kSealBytes * 2;
  mooncake::shm_seal(t, claimed, secret_);
  expect_refused(address_of(t, 1, 0), secret_, t);
}

// An all-zero header names slot 0, incarnation 0: only the seal tells it
// from a member's.
TEST_F(ShmSeal, AnUnsealedSegmentOfTheRightSizeIsRefused) {
  Segment blank(kSealBytes);
  fill(blank);
  expect_refused(address_of(blank, 0, 0), secret_, blank, "rank 0 (incarnation 0)");
  expect_refused(address_of(blank, 3, 2), secret_, blank);
}

TEST_F(ShmSeal, ASegmentOfAnotherSizeIsRefused) {
  for (uint64_t bytes : {uint64_t{kSealBytes / 2}, uint64_t{kSealBytes - 8},
                         uint64_t{kSealBytes + 4096}, uint64_t{kSealBytes * 2}}) {
    PeerAddress addr = me_;
    addr.segment_bytes = bytes;
    expect_refused(addr, secret_, target_, "is not a " + std::to_string(bytes) + "-byte segment");
  }
}

// A plain file of the right size, such as a reused pid's process may hold
// at the published fd, with some pattern in it.
TEST_F(ShmSeal, APlainFileOfTheRightSizeIsRefusedAndLeftUnchanged) {
  TempDir dir;
  const std::string path = dir.path() + "/plain";
  const int fd = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> pattern(kSealBytes);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 131 + 17);
  ASSERT_EQ(::pwrite(fd, pattern.data(), pattern.size(), 0), static_cast<ssize_t>(kSealBytes));
  PeerAddress addr = me_;
  addr.segment_fd = fd;
  const std::vector<uint8_t> before = bytes_of(target_);
  for (int rank : {0, 3}) {
    addr.rank = rank;
    EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, [&] { mooncake::shm_connect(addr, secret_); }))
        << "rank " << rank;
  }
  std::vector<uint8_t> after(kSealBytes);
  ASSERT_EQ(::pread(fd, after.data(), after.size(), 0), static_cast<ssize_t>(kSealBytes));
  EXPECT_TRUE(after == pattern) << "the refused file was changed";
  EXPECT_TRUE(bytes_of(target_) == before);
  ::close(fd);
}

TEST_F(ShmSeal, APipeIsRefused) {
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC | O_NONBLOCK), 0);
  for (int end : {0, 1}) {
    PeerAddress addr = me_;
    addr.segment_fd = p[end];
    EXPECT_TRUE(throws_error(
        ErrorKind::kPeerFailed, [&] { mooncake::shm_connect(addr, secret_); }, "-byte segment"))
        << "pipe end " << end;
  }
  char c;
  EXPECT_EQ(::read(p[0], &c, 1), -1) << "something was written into the pipe";
  EXPECT_EQ(errno, EAGAIN);
  ::close(p[0]);
  ::close(p[1]);
}

TEST_F(ShmSeal, ACharacterDeviceIsRefused) {
  const int fd = ::open("/dev/zero", O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  PeerAddress addr = me_;
  addr.segment_fd = fd;
  EXPECT_TRUE(throws_error(
      ErrorKind::kPeerFailed, [&] { mooncake::shm_connect(addr, secret_); }, "-byte segment"));
  ::close(fd);
}

// A directory cannot even be opened for writing. shm.h promises kPeerFailed
// for a file that is not the published segment; see the report of this test.
TEST_F(ShmSeal, ADirectoryIsRefused) {
  TempDir dir;
  const int fd = ::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  PeerAddress addr = me_;
  addr.segment_fd = fd;
  EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, [&] { mooncake::shm_connect(addr, secret_); }));
  ::close(fd);
}

TEST_F(ShmSeal, ASocketIsRefused) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  PeerAddress addr = me_;
  addr.segment_fd = sv[0];
  EXPECT_TRUE(throws_error(ErrorKind::kPeerFailed, [&] { mooncake::shm_connect(addr, secret_); }));
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST_F(ShmSeal, AfterRefusalsTheRightAddressStillConnects) {
  PeerAddress wrong = me_;
  wrong.incarnation = 9;
  expect_refused(wrong, secret_, target_);
  expect_refused(me_, mooncake::random_secret(), target_);
  auto link = mooncake::shm_connect(me_, secret_);
  const uint64_t v = 42;
  link->write(kSealBytes - 8, &v, sizeof(v), Deadline::after_ms(1000));
  EXPECT_EQ(mooncake::load_flag(target_.base(), kSealBytes - 8), 42u);
}

TEST_F(ShmSeal, ASecretOfAnotherLengthIsAnInvalidArgument) {
  for (const std::string& bad : {std::string(), secret_.substr(0, 31), secret_ + "0"}) {
    EXPECT_TRUE(throws_error(
        ErrorKind::kInvalidArgument, [&] { mooncake::shm_connect(me_, bad); }, "secret"))
        << bad.size();
    Segment s(kSealBytes);
    const std::vector<uint8_t> before = bytes_of(s);
    EXPECT_TRUE(throws_error(
        ErrorKind::kInvalidArgument, [&] { mooncake::shm_seal(s, address_of(s, 0, 0), bad); },
        "secret"))
        << bad.size();
    EXPECT_TRUE(bytes_of(s) == before);
  }
}

}  // namespace
}  // namespace mctest
