// tcp_connect keeps to its deadline when nothing answers: a peer whose host is
// gone (powered off, cut off) drops the SYN instead of refusing it, and a
// blocking connect(2) would wait out the kernel's SYN retries (about two
// minutes), whatever the caller's deadline. The elastic EP buffer's probe of a
// dead process (200 ms) and the admission of a newcomer (1 s) count on it.
//
// A listener whose accept queue is full stands for that host: the kernel drops
// every further SYN to it. tcp_probe (what the ucx transport dials before
// UCX's blocking connect) keeps to its deadline alike, and passes for a live
// receiver without a word to it.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "core/clock.h"
#include "core/error.h"
#include "transport/secret.h"
#include "transport/segment.h"
#include "transport/tcp.h"

namespace mctest {
namespace {

using mooncake::Deadline;
using mooncake::Error;
using mooncake::ErrorKind;

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

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

TEST(TcpConnect, AProbeEndsAtTheDeadlineAndPassesForALiveReceiver) {
  Unanswered gone;
  expect_timeout_at_deadline([&](const Deadline& d) { mooncake::tcp_probe(gone.addr, d); });
  mooncake::Segment segment(8192);
  mooncake::TcpReceiver receiver(segment, 2, "127.0.0.1", mooncake::random_secret());
  mooncake::PeerAddress live = gone.addr;
  live.tcp_port = receiver.port();
  mooncake::tcp_probe(live, Deadline::after_ms(2000));
  EXPECT_EQ(receiver.rejected(), 0u);  // a close before any hello is no offence
}

TEST(TcpConnect, ANeverAnsweredConnectEndsAtTheDeadline) {
  Unanswered gone;
  mooncake::Segment segment(8192);
  mooncake::TcpReceiver receiver(segment, 2, "127.0.0.1", mooncake::random_secret());
  expect_timeout_at_deadline([&](const Deadline& d) {
    mooncake::tcp_connect(gone.addr, 0, 0, mooncake::random_secret(), receiver, d);
  });
}

}  // namespace
}  // namespace mctest
