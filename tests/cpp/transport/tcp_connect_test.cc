// tcp_connect keeps to its deadline when nothing answers: a peer whose host is
// gone (powered off, cut off) drops the SYN instead of refusing it, and a
// blocking connect(2) would wait out the kernel's SYN retries (about two
// minutes), whatever the caller's deadline. The elastic EP buffer's probe of a
// dead process (200 ms) and the admission of a newcomer (1 s) count on it.
//
// A listener whose accept queue is full stands for that host: the kernel drops
// every further SYN to it.
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

TEST(TcpConnect, ANeverAnsweredConnectEndsAtTheDeadline) {
  Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_GE(listener.get(), 0);
  sockaddr_in sa = loopback(0);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(listener.get(), 0), 0);  // room for one connection, never accepted
  socklen_t len = sizeof(sa);
  ASSERT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const int port = ntohs(sa.sin_port);
  Fd filler(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_EQ(::connect(filler.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);

  mooncake::Segment segment(8192);
  mooncake::TcpReceiver receiver(segment, 2, "127.0.0.1", mooncake::random_secret());
  mooncake::PeerAddress addr;
  addr.rank = 1;
  addr.host_key = "another host";
  addr.segment_bytes = segment.size();
  addr.tcp_host = "127.0.0.1";
  addr.tcp_port = port;

  const auto t0 = std::chrono::steady_clock::now();
  try {
    mooncake::tcp_connect(addr, 0, 0, mooncake::random_secret(), receiver, Deadline::after_ms(300));
    FAIL() << "connected to a listener that takes nobody in";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.25);
  EXPECT_LT(took, 2.0);  // a blocking connect would wait about two minutes
}

}  // namespace
}  // namespace mctest
