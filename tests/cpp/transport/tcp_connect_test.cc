// tcp_connect keeps to its deadline when nothing answers: a peer whose host is
// gone (powered off, cut off) drops the SYN instead of refusing it, and a
// blocking connect(2) would wait out the kernel's SYN retries (about two
// minutes), whatever the caller's deadline. The elastic EP buffer's probe of a
// dead process (200 ms) and the admission of a newcomer (1 s) count on it.
//
// A listener whose accept queue is full stands for that host: the kernel drops
// every further SYN to it. tcp_probe (what the ucx transport dials before
// UCX's blocking connect) keeps to its deadline alike.
//
// A connection the kernel completes proves nothing: a dying process's
// listener still completes handshakes while its threads are gone, and a dead
// process's port may belong to another process since. Both calls return only
// once the receiver they address has welcomed their hello.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "core/clock.h"
#include "core/error.h"
#include "core/unique_fd.h"
#include "transport/secret.h"
#include "transport/segment.h"
#include "transport/tcp.h"
#include "transport/tcp_wire.h"

namespace mctest {
namespace {

using mooncake::Deadline;
using mooncake::Error;
using mooncake::ErrorKind;
using Fd = mooncake::UniqueFd;

sockaddr_in loopback(int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return sa;
}

// A listener that takes nobody in, and the address of a peer behind it.
class Unanswered {
 public:
  Unanswered() {
    sockaddr_in sa = loopback(0);
    EXPECT_EQ(::bind(listener_.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    EXPECT_EQ(::listen(listener_.get(), 0), 0);  // room for one connection, never accepted
    socklen_t len = sizeof(sa);
    EXPECT_EQ(::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&sa), &len), 0);
    EXPECT_EQ(::connect(filler_.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    addr.rank = 1;
    addr.host_key = "another host";
    addr.segment_bytes = 8192;
    addr.tcp_host = "127.0.0.1";
    addr.tcp_port = ntohs(sa.sin_port);
  }
  mooncake::PeerAddress addr;

 private:
  Fd listener_{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  Fd filler_{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
};

// Runs `dial`, which must throw kTimeout naming rank 1 after about 300 ms.
template <typename F>
void expect_timeout_at_deadline(F&& dial) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    dial(Deadline::after_ms(300));
    FAIL() << "connected to a listener that takes nobody in";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.25);
  EXPECT_LT(took, 2.0);  // a blocking connect would wait about two minutes
}

// Rank 1's receiver (incarnation 0) in this process, and its address.
struct LiveReceiver {
  std::string secret = mooncake::random_secret();
  mooncake::Segment segment{8192};
  mooncake::TcpReceiver receiver{segment, 2, 1, 0, "127.0.0.1", secret};
  mooncake::PeerAddress addr = [this] {
    mooncake::PeerAddress a = Unanswered().addr;
    a.tcp_port = receiver.port();
    return a;
  }();
};

TEST(TcpConnect, AProbeEndsAtTheDeadlineAndPassesForALiveReceiver) {
  Unanswered gone;
  const std::string secret = mooncake::random_secret();
  expect_timeout_at_deadline(
      [&](const Deadline& d) { mooncake::tcp_probe(gone.addr, 0, 0, secret, d); });
  LiveReceiver live;
  mooncake::tcp_probe(live.addr, 0, 0, live.secret, Deadline::after_ms(2000));
  EXPECT_EQ(live.receiver.rejected(), 0u);
  // The probe said bye: its close is not rank 0's death.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(live.receiver.peer_closed(0, 0));
}

TEST(TcpConnect, ANeverAnsweredConnectEndsAtTheDeadline) {
  Unanswered gone;
  LiveReceiver mine;
  expect_timeout_at_deadline([&](const Deadline& d) {
    mooncake::tcp_connect(gone.addr, 0, 0, mine.secret, mine.receiver, d);
  });
}

// A listener that completes handshakes and never reads: a process whose
// threads are gone while its sockets still stand.
TEST(TcpConnect, AConnectionNobodyWelcomesEndsAtTheDeadline) {
  Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in sa = loopback(0);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(listener.get(), 8), 0);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&sa), &len), 0);
  LiveReceiver mine;
  mooncake::PeerAddress dying = mine.addr;
  dying.tcp_port = ntohs(sa.sin_port);
  expect_timeout_at_deadline([&](const Deadline& d) {
    mooncake::tcp_connect(dying, 0, 0, mine.secret, mine.receiver, d);
  });
  expect_timeout_at_deadline(
      [&](const Deadline& d) { mooncake::tcp_probe(dying, 0, 0, mine.secret, d); });
}

// Rank 1's receiver is incarnation 0: a connect for its incarnation 1 (whose
// address named this port) or for rank 0 is refused at once, and neither
// side takes anyone for alive or dead; a connect for it is welcomed.
TEST(TcpConnect, OnlyTheAddressedProcessWelcomesAConnect) {
  LiveReceiver live;
  for (auto [rank, inc] : {std::pair{1, 1u}, std::pair{0, 0u}}) {
    mooncake::PeerAddress other = live.addr;
    other.rank = rank;
    other.incarnation = inc;
    try {
      mooncake::tcp_connect(other, 0, 0, live.secret, live.receiver, Deadline::after_ms(2000));
      ADD_FAILURE() << "rank 1 incarnation 0 welcomed a connect for rank " << rank
                    << " incarnation " << inc;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kPeerFailed) << e.what();
      EXPECT_NE(std::string(e.what()).find("closed the connection before answering its hello"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(live.receiver.rejected(), 2u);
  EXPECT_FALSE(live.receiver.peer_closed(0, 0));
  auto link =
      mooncake::tcp_connect(live.addr, 0, 0, live.secret, live.receiver, Deadline::after_ms(2000));
  EXPECT_TRUE(link->alive());
}

// Rank 0 connects to rank 1 twice with one incarnation (a link made again,
// as an elastic connect that is retried does), then its first link closes
// without a goodbye: that close, whenever rank 1 reads it, is not rank 0's
// death while the second link lives. A close of the second is. A new
// connection after that shows rank 0 alive again.
TEST(TcpConnect, OnlyTheLatestConnectionOfAnIncarnationSaysItClosed) {
  LiveReceiver live;
  const auto connect = [&] {
    return mooncake::tcp_connect(live.addr, 0, 0, live.secret, live.receiver,
                                 Deadline::after_ms(2000));
  };
  // Polls for up to `ms`: whether rank 1 comes to take rank 0 for closed.
  const auto closed_within = [&](int ms) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < until) {
      if (live.receiver.peer_closed(0, 0)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return live.receiver.peer_closed(0, 0);
  };
  auto first = connect();
  auto second = connect();
  first.reset();  // closes without a goodbye
  EXPECT_FALSE(closed_within(300)) << "the replaced connection's close took rank 0 for dead";
  EXPECT_FALSE(live.receiver.read_to_end(0, 0)) << "the replaced connection's end ended rank 0's";
  second.reset();
  EXPECT_TRUE(closed_within(2000))
      << "the latest connection closed and rank 0 is not taken for dead";
  EXPECT_TRUE(live.receiver.read_to_end(0, 0));
  auto third = connect();
  EXPECT_FALSE(live.receiver.peer_closed(0, 0)) << "a new connection did not show rank 0 alive";
  EXPECT_EQ(live.receiver.rejected(), 0u);
}

// Rank 0's link closes without a goodbye (it died), then a connection in its
// name says hello and is reset at once, so the welcome cannot be sent: that
// connection never counted, and rank 0 stays closed.
TEST(TcpConnect, AHelloWhoseWelcomeFailsDoesNotReopenAClosedPeer) {
  LiveReceiver live;
  auto link =
      mooncake::tcp_connect(live.addr, 0, 0, live.secret, live.receiver, Deadline::after_ms(2000));
  link.reset();
  // Whether rank 1 takes rank 0 for closed and read to its end within 2 s (a
  // connection that is let in and then reset closes it again meanwhile).
  const auto closed_within_2s = [&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!(live.receiver.peer_closed(0, 0) && live.receiver.read_to_end(0, 0)) &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return live.receiver.peer_closed(0, 0) && live.receiver.read_to_end(0, 0);
  };
  ASSERT_TRUE(closed_within_2s());
  for (int i = 0; i < 5; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa = loopback(live.receiver.port());
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    const mooncake::Frame hello{mooncake::kHello, static_cast<uint32_t>(mooncake::kSecretBytes),
                                mooncake::hello_word(0, 0), mooncake::hello_word(0, 1)};
    std::string bytes(reinterpret_cast<const char*>(&hello), sizeof(hello));
    bytes += live.secret;
    EXPECT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
    const linger reset{1, 0};  // close with a reset, not a goodbye or a FIN
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the reset read
    EXPECT_TRUE(closed_within_2s()) << "try " << i << ": a reset hello reopened rank 0";
  }
}

// A raw connection in rank 0's name (incarnation 0) to `live`, welcomed: a
// connection whose bytes the test writes itself (its fd, the caller's to close).
int raw_hello(LiveReceiver& live) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in sa = loopback(live.receiver.port());
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  const mooncake::Frame hello{mooncake::kHello, static_cast<uint32_t>(mooncake::kSecretBytes),
                              mooncake::hello_word(0, 0), mooncake::hello_word(0, 1)};
  std::string bytes(reinterpret_cast<const char*>(&hello), sizeof(hello));
  bytes += live.secret;
  EXPECT_EQ(::send(fd.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
  mooncake::Frame welcome{};
  const timeval two_s{2, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &two_s, sizeof(two_s));
  EXPECT_EQ(::recv(fd.get(), &welcome, sizeof(welcome), MSG_WAITALL),
            static_cast<ssize_t>(sizeof(welcome)));
  EXPECT_EQ(welcome.type, mooncake::kWelcome);
  return fd.release();
}

// Connects in rank 0's name again (replacing the connections before) and
// closes without a goodbye; returns once the receiver has read that close.
void newer_connection_closes(LiveReceiver& live) {
  auto newer =
      mooncake::tcp_connect(live.addr, 0, 0, live.secret, live.receiver, Deadline::after_ms(2000));
  std::atomic<uint32_t>& seq = live.segment.bell(0)->seq;
  const uint32_t before = seq.load();
  newer.reset();
  // A drop rings every bell; nothing else rings one meanwhile.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (seq.load() == before && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_NE(seq.load(), before) << "the newer connection's close was not read in 2 s";
}

// Polls for up to `s` seconds: whether rank 0 comes to be taken for gone.
bool gone_within(LiveReceiver& live, int s) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(s);
  while (!live.receiver.peer_closed(0, 0) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return live.receiver.peer_closed(0, 0) && live.receiver.read_to_end(0, 0);
}

// Rank 0 wrote on a connection it then replaced, and the replacing one closes
// first, without a goodbye: rank 0 is not taken for gone, nor read to its end,
// while the older connection still holds bytes rank 0 wrote; once that one is
// read to its end, it is, and the bytes are in place.
TEST(TcpConnect, AReplacedConnectionsBytesAreReadBeforeThePeerCountsAsGone) {
  LiveReceiver live;
  const Fd old_conn(raw_hello(live));
  ASSERT_FALSE(HasFailure());
  const auto send_bytes = [&](const void* p, size_t n) {
    return ::send(old_conn.get(), p, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
  };
  // Half of a write on the old connection, then a newer connection that ends.
  constexpr size_t kAt = mooncake::kSegmentHeaderBytes, kLen = 512;
  std::string data(kLen, '\0');
  for (size_t i = 0; i < kLen; ++i) data[i] = static_cast<char>(i * 13 + 5);
  const mooncake::Frame write{mooncake::kWrite, 0, kAt, kLen};
  ASSERT_TRUE(send_bytes(&write, sizeof(write)));
  ASSERT_TRUE(send_bytes(data.data(), kLen / 2));
  newer_connection_closes(live);
  EXPECT_FALSE(live.receiver.peer_closed(0, 0)) << "taken for gone with bytes still to read";
  EXPECT_FALSE(live.receiver.read_to_end(0, 0));
  ASSERT_TRUE(send_bytes(data.data() + kLen / 2, kLen / 2));
  ::shutdown(old_conn.get(), SHUT_WR);  // the old connection ends too
  EXPECT_TRUE(gone_within(live, 2)) << "not taken for gone once both ended";
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(live.segment.base()) + kAt, kLen), data);
}

// A replaced connection that stays open and quiet (its peer's host cut off, or
// a child process holding the socket) delays the latest one's close only for
// the grace: then rank 0 is taken for gone.
TEST(TcpConnect, AQuietReplacedConnectionDelaysThePeersEndOnlyForTheGrace) {
  LiveReceiver live;
  const Fd old_conn(raw_hello(live));
  ASSERT_FALSE(HasFailure());
  const auto closed = std::chrono::steady_clock::now();
  newer_connection_closes(live);
  EXPECT_FALSE(live.receiver.peer_closed(0, 0)) << "taken for gone before the grace";
  EXPECT_TRUE(gone_within(live, 5)) << "an open replaced connection kept rank 0 alive";
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - closed).count();
  EXPECT_GE(took, mooncake::TcpReceiver::kReplacedGraceUs * 1e-6 * 0.9);
}

// Slot 0's process of incarnation 0 still beats after incarnation 1 has
// connected (left out, then resumed): its frames are no life of the new one.
TEST(TcpConnect, AReplacedIncarnationsFramesAreNoLifeOfTheNewOne) {
  LiveReceiver live;
  auto old_link =
      mooncake::tcp_connect(live.addr, 0, 0, live.secret, live.receiver, Deadline::after_ms(2000));
  auto new_link =
      mooncake::tcp_connect(live.addr, 0, 1, live.secret, live.receiver, Deadline::after_ms(2000));
  const uint64_t before = live.receiver.frames(0, 1);
  for (int i = 0; i < 20; ++i) old_link->beat();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(live.receiver.frames(0, 1), before) << "the old incarnation's heartbeats counted";
  new_link->beat();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (live.receiver.frames(0, 1) == before && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_GT(live.receiver.frames(0, 1), before) << "the new incarnation's heartbeat did not count";
}

}  // namespace
}  // namespace mctest
