#include "transport/tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"
#include "core/thread.h"
#include "core/unique_fd.h"

namespace mooncake {

namespace {

void set_nonblocking(int fd) {
  int flags = MC_SYSCHECK(::fcntl(fd, F_GETFL));
  MC_SYSCHECK(::fcntl(fd, F_SETFL, flags | O_NONBLOCK));
}

// connect(2) on a non-blocking `fd`, waiting no longer than `deadline`;
// returns 0 or the errno. A blocking connect to a host that is gone (its SYN
// dropped, not refused) would wait out the kernel's retries, minutes.
int connect_by(int fd, const sockaddr* to, socklen_t len, const Deadline& deadline) {
  if (::connect(fd, to, len) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  for (;;) {
    pollfd p{fd, POLLOUT, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(deadline.remaining_ms(1000)));
    if (ready < 0 && errno != EINTR) return errno;
    if (ready > 0) {
      int err = 0;
      socklen_t n = sizeof(err);
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &n) != 0) return errno;
      return err;
    }
    if (deadline.expired()) return ETIMEDOUT;
  }
}

}  // namespace

struct TcpReceiver::Conn {
  int fd = -1;
  FrameDecoder decoder;
  int64_t opened_us = 0;
  std::string from;  // the peer's ip:port, for logs
  std::string why;   // set when the connection broke the protocol
  uint64_t id = 0;   // in order of the hellos welcomed (0: none yet)
};

TcpReceiver::TcpReceiver(Segment& segment, int world_capacity, int rank, uint32_t incarnation,
                         const std::string& bind_host, std::string secret,
                         std::atomic<uint64_t>* alarm)
    : segment_(segment),
      peers_(new PeerState[static_cast<size_t>(world_capacity)]),
      capacity_(world_capacity),
      rank_(rank),
      incarnation_(incarnation),
      secret_(std::move(secret)),
      alarm_(alarm) {
  check_secret(secret_, "tcp");
  listen_fd_ = MC_SYSCHECK(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  if (!bind_host.empty() && ::inet_pton(AF_INET, bind_host.c_str(), &sa.sin_addr) != 1)
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
  MC_SYSCHECK(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)));
  MC_SYSCHECK(::listen(listen_fd_, 128));
  socklen_t len = sizeof(sa);
  MC_SYSCHECK(::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len));
  port_ = ntohs(sa.sin_port);
  set_nonblocking(listen_fd_);
  wake_fd_ = MC_SYSCHECK(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  thread_ = std::thread([this] {
    begin_library_thread("mc-tcp");
    run();
  });
}

TcpReceiver::~TcpReceiver() {
  uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof(one)) < 0) { /* thread may be gone */
  }
  if (thread_.joinable()) thread_.join();
  ::close(wake_fd_);
  ::close(listen_fd_);
}

bool TcpReceiver::peer_closed(int rank, uint32_t inc) const {
  const PeerState& p = peers_[rank];
  return p.closed_inc.load(std::memory_order_acquire) == inc + 1 ||
         p.hello_inc.load(std::memory_order_acquire) > inc + 1;
}

bool TcpReceiver::read_to_end(int rank, uint32_t inc) const {
  return peers_[rank].ended_inc.load(std::memory_order_acquire) == inc + 1 ||
         peer_closed(rank, inc);
}

uint64_t TcpReceiver::frames(int rank, uint32_t inc) const {
  const PeerState& p = peers_[rank];
  return p.hello_inc.load(std::memory_order_acquire) == inc + 1
             ? p.frames.load(std::memory_order_relaxed)
             : 0;
}

// Reads whatever is available on `c`; false when the connection is finished
// (closed by the peer, or broken: then c.why says how).
bool TcpReceiver::drain(Conn& c) {
  for (;;) {
    const std::span<uint8_t> into = c.decoder.next();
    ssize_t n = ::recv(c.fd, into.data(), into.size(), 0);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    if (c.decoder.authenticated()) {
      PeerState& p = peers_[c.decoder.rank()];
      if (p.hello_inc.load(std::memory_order_relaxed) == c.decoder.incarnation() + 1)
        p.read_us.store(now_us(), std::memory_order_relaxed);
    }
    switch (c.decoder.advance(static_cast<size_t>(n))) {
      case FrameDecoder::Step::kMore: break;
      case FrameDecoder::Step::kFrame: {
        // Life of the slot's latest incarnation only: a process it replaced
        // that still beats (left out, resumed) must not keep it looking alive.
        PeerState& p = peers_[c.decoder.rank()];
        if (p.hello_inc.load(std::memory_order_relaxed) == c.decoder.incarnation() + 1)
          p.frames.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      case FrameDecoder::Step::kHello: {
        PeerState& p = peers_[c.decoder.rank()];
        const uint32_t inc = c.decoder.incarnation() + 1;
        if (p.hello_inc.load() > inc) return false;  // a stale incarnation
        // The latest connection of the peer from here on (its close speaks for
        // it, an older one's no longer), and a new connection from an
        // incarnation whose last one closed: it lives. Before the welcome, so
        // that a caller the welcome lets go finds it so; undone if it fails.
        const uint64_t last = p.conn;
        uint32_t closed = inc;
        const bool reopened =
            p.closed_inc.compare_exchange_strong(closed, 0, std::memory_order_acq_rel);
        c.id = p.conn = ++hellos_;
        // The welcome: 24 bytes into a new connection's empty send buffer.
        const Frame welcome{kWelcome, 0, incarnation_, static_cast<uint64_t>(rank_)};
        if (::send(c.fd, &welcome, sizeof(welcome), MSG_NOSIGNAL | MSG_DONTWAIT) !=
            static_cast<ssize_t>(sizeof(welcome))) {
          // The sender has gone already (reset after its hello): this
          // connection never counted.
          p.conn = last;
          if (reopened) p.closed_inc.store(inc, std::memory_order_release);
          return false;
        }
        c.decoder.accept();
        if (p.open_inc != inc) {
          p.open_inc = inc;
          p.open = 0;
        }
        ++p.open;
        if (p.ended_pending != 0) --pending_;
        p.ended_pending = 0;  // the latest connection lives
        p.frames.store(0);
        p.ended_inc.store(0, std::memory_order_relaxed);  // this connection has not ended
        p.hello_inc.store(inc, std::memory_order_release);
        break;
      }
      case FrameDecoder::Step::kBroken: c.why = c.decoder.why(); return false;
    }
  }
}

void TcpReceiver::drop(Conn& c) {
  // A connection the peer has replaced with a newer one: its close, read
  // late, would take a live peer for dead.
  const bool replaced = c.decoder.authenticated() && peers_[c.decoder.rank()].conn > c.id;
  if (!c.why.empty()) {
    rejected_.fetch_add(1, std::memory_order_relaxed);
    if (log_limit_.allow("tcp connections dropped"))
      MC_LOG(kWarn, "tcp: dropped the connection from ", c.from,
             c.decoder.authenticated() ? str(" (rank ", c.decoder.rank(), ")") : std::string(),
             ": ", c.why);
  } else {
    MC_LOG(kDebug, "tcp: ", replaced ? "a replaced " : "", "connection from rank ",
           c.decoder.rank(), " closed");
  }
  // Only an authenticated peer's latest connection says something about that
  // peer: it has ended (all it carried is in place), and closed unless it said
  // goodbye. Said once every connection of that incarnation has been read to
  // its end: one it replaced may still hold bytes it wrote before.
  if (c.decoder.authenticated()) {
    PeerState& p = peers_[c.decoder.rank()];
    const uint32_t inc = c.decoder.incarnation() + 1;
    if (p.open_inc == inc && p.open > 0) --p.open;
    if (!replaced) {
      if (p.ended_pending == 0) ++pending_;
      p.ended_pending = inc;
      p.closed_pending = !c.decoder.bye();
      p.pending_us = now_us();
    }
    settle(p, false);
  }
  ::close(c.fd);
  c.fd = -1;
  wake_waiters();
}

void TcpReceiver::wake_waiters() {
  for (int b = 0; b < kNumBells; ++b) ring(segment_.bell(b));
}

void TcpReceiver::settle(PeerState& p, bool force) {
  if (p.ended_pending == 0 || (p.open > 0 && !force)) return;
  const uint32_t inc = p.ended_pending;
  p.ended_pending = 0;
  --pending_;
  p.ended_inc.store(inc, std::memory_order_release);
  if (p.closed_pending) {
    p.closed_inc.store(inc, std::memory_order_release);
    if (alarm_) alarm_->fetch_add(1, std::memory_order_acq_rel);
  }
}

void TcpReceiver::settle_quiet() {
  const int64_t now = now_us();
  for (int r = 0; r < capacity_ && pending_ > 0; ++r) {
    PeerState& p = peers_[r];
    if (p.ended_pending != 0 && now - p.pending_us > kReplacedGraceUs &&
        now - p.read_us.load(std::memory_order_relaxed) > kReplacedGraceUs) {
      settle(p, true);
      wake_waiters();
    }
  }
}

void TcpReceiver::run() {
  std::vector<Conn> conns;
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto& c : conns) fds.push_back({c.fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), pending_ > 0 ? 100 : 1000) < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;
    if (pending_ > 0) settle_quiet();
    if (fds[1].revents & POLLIN) {
      int accepted = 0;
      for (;;) {
        sockaddr_in sa{};
        socklen_t len = sizeof(sa);
        int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len,
                           SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;
        char ip[INET_ADDRSTRLEN] = "?";
        ::inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
        const std::string from = str(ip, ":", ntohs(sa.sin_port));
        // Full: those whose hello has arrived are let in first (a member that
        // connected just before a flood is not pushed out), then the one that
        // has waited longest makes room (a flood of silent connections cannot
        // lock real peers out).
        auto waiting = [&conns](Conn** oldest) {
          int n = 0;
          for (Conn& k : conns) {
            if (k.fd < 0 || k.decoder.authenticated()) continue;
            ++n;
            if (*oldest == nullptr || k.opened_us < (*oldest)->opened_us) *oldest = &k;
          }
          return n;
        };
        Conn* oldest = nullptr;
        if (waiting(&oldest) >= kMaxUnauthenticated) {
          for (Conn& k : conns)
            if (k.fd >= 0 && !k.decoder.authenticated() && !drain(k)) drop(k);
          oldest = nullptr;
          const int n = waiting(&oldest);
          if (n >= kMaxUnauthenticated) {
            oldest->why = str(n, " connections wait for their hello; the oldest makes room");
            drop(*oldest);
          }
        }
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        conns.push_back(Conn{
            fd,
            FrameDecoder(segment_.base(), segment_.size(), capacity_, secret_, rank_, incarnation_),
            now_us(),
            from,
            {}});
        if (++accepted == kMaxUnauthenticated) break;  // serve the others too
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Conn& c = conns[i - 2];
      if (c.fd >= 0 && !drain(c)) drop(c);  // fd < 0: dropped to make room
    }
    const int64_t now = now_us();
    for (Conn& c : conns) {
      if (c.fd >= 0 && !c.decoder.authenticated() && now - c.opened_us > kHelloTimeoutMs * 1000) {
        c.why = str("no hello within ", kHelloTimeoutMs, " ms");
        drop(c);
      }
    }
    std::erase_if(conns, [](const Conn& c) { return c.fd < 0; });
  }
  for (auto& c : conns) ::close(c.fd);
}

namespace {

class TcpLink : public PeerLink {
 public:
  TcpLink(int fd, int peer, uint32_t inc, uint64_t peer_bytes, TcpReceiver& receiver)
      : fd_(fd), peer_(peer), inc_(inc), peer_bytes_(peer_bytes), receiver_(receiver) {}
  ~TcpLink() override { ::close(fd_); }
  const char* transport() const override { return "tcp"; }

  void write(size_t offset, const void* src, size_t len, const Deadline& deadline) override {
    MC_ASSERT(offset + len <= peer_bytes_, "write past the peer segment");
    Frame f{kWrite, 0, offset, len};
    std::lock_guard<std::mutex> lock(mu_);
    send_all(&f, sizeof(f), deadline);
    send_all(src, len, deadline);
  }

  void signal(size_t offset, uint64_t value, int bell, const Deadline& deadline) override {
    send_signal(kSignal, offset, value, bell, deadline);
  }

  void signal_max(size_t offset, uint64_t value, int bell, const Deadline& deadline) override {
    send_signal(kSignalMax, offset, value, bell, deadline);
  }

  bool alive() override {
    if (gone_.load(std::memory_order_acquire)) return false;
    bool live = false;
    if (!receiver_.peer_closed(peer_, inc_)) {
      if (!broken_.load(std::memory_order_acquire)) return true;
      // Our send broke first (the reset of a peer that exited), while what
      // it sent before it went may still wait, unread, on its own
      // connection: gone once that one is read to its end, or after a grace
      // with nothing read, and at most a limit after the break (a connection
      // broken one way only, whose peer's heartbeats go on coming).
      const int64_t now = now_us(), broke = broken_at_us_.load(std::memory_order_relaxed);
      const int64_t since = std::max(broke, receiver_.last_read_us(peer_));
      live = !receiver_.read_to_end(peer_, inc_) && now - since < kBrokenGraceUs &&
             now - broke < kBrokenLimitUs;
    }
    if (!live) gone_.store(true, std::memory_order_release);  // seen gone: gone for good
    return live;
  }
  void farewell() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return;
    Frame f{kBye, 0, 0, 0};
    try {
      send_all(&f, sizeof(f), Deadline::after_ms(100));
    } catch (const Error&) {
      // A peer that cannot take it is gone, or will see the close.
    }
  }
  uint64_t heartbeat() override { return receiver_.frames(peer_, inc_); }
  void beat() override {
    // Skipped while an op sends on the link: its own frames tell the peer
    // this process runs.
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || broken_) return;
    Frame f{kHeartbeat, 0, 0, 0};
    try {
      send_all(&f, sizeof(f), Deadline::after_ms(100));
    } catch (const Error&) {
      // A peer that cannot take a heartbeat is found out by the ops.
    }
  }

  void send_signal(FrameType type, size_t offset, uint64_t value, int bell,
                   const Deadline& deadline) {
    MC_ASSERT(offset + 8 <= peer_bytes_ && bell >= 0 && bell < kNumBells,
              "signal past the peer segment");
    Frame f{type, static_cast<uint32_t>(bell), offset, value};
    std::lock_guard<std::mutex> lock(mu_);
    send_all(&f, sizeof(f), deadline);
  }

  void send_all(const void* data, size_t len, const Deadline& deadline) {
    const char* p = static_cast<const char*>(data);
    while (len > 0) {
      if (broken_)
        throw_error(ErrorKind::kPeerFailed, peer_, "tcp link to rank ", peer_, " is closed");
      ssize_t n = ::send(fd_, p, len, MSG_NOSIGNAL);
      if (n > 0) {
        p += n;
        len -= static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        if (deadline.expired())
          throw_error(ErrorKind::kTimeout, peer_, "tcp send to rank ", peer_, " timed out");
        if (!alive())
          throw_error(ErrorKind::kPeerFailed, peer_, "rank ", peer_, " closed its connection");
        pollfd pfd{fd_, POLLOUT, 0};
        ::poll(&pfd, 1, static_cast<int>(deadline.remaining_ms(50)));
        continue;
      }
      broken_at_us_.store(now_us(), std::memory_order_relaxed);
      broken_.store(true, std::memory_order_release);
      throw_error(ErrorKind::kPeerFailed, peer_, "tcp send to rank ", peer_,
                  " failed: ", std::strerror(errno));
    }
  }

 private:
  int fd_;
  int peer_;
  uint32_t inc_;
  uint64_t peer_bytes_;
  TcpReceiver& receiver_;
  std::mutex mu_;
  static constexpr int64_t kBrokenGraceUs = 500'000, kBrokenLimitUs = 2'000'000;
  std::atomic<bool> broken_{false};  // alive() reads it without mu_
  std::atomic<int64_t> broken_at_us_{0};
  std::atomic<bool> gone_{false};  // alive() said false once
};

}  // namespace

namespace {

// A connected socket to the receiver of the peer at `addr`, tried until
// `deadline`. The published address first: a receiver bound to
// MOONCAKE_HOST_IP listens there only. A peer on this host is also tried on
// the loopback, for hosts whose name resolves to an address they cannot
// reach themselves.
int tcp_dial(const PeerAddress& addr, const Deadline& deadline) {
  std::vector<std::string> hosts = {addr.tcp_host};
  if (addr.host_key == local_host_key() && addr.tcp_host != "127.0.0.1")
    hosts.push_back("127.0.0.1");
  for (size_t attempt = 0;; ++attempt) {
    const std::string& host = hosts[attempt % hosts.size()];
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = ::getaddrinfo(host.c_str(), std::to_string(addr.tcp_port).c_str(), &hints, &res);
    if (rc != 0)
      throw_error(ErrorKind::kSystem, addr.rank, "cannot resolve ", host, " for rank ", addr.rank,
                  ": ", gai_strerror(rc));
    const int fd = MC_SYSCHECK(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    const int e = connect_by(fd, res->ai_addr, res->ai_addrlen, deadline);
    ::freeaddrinfo(res);
    if (e == 0) return fd;
    ::close(fd);
    if (deadline.expired())
      throw_error(ErrorKind::kTimeout, addr.rank, "cannot connect to rank ", addr.rank, " at ",
                  host, ":", addr.tcp_port, ": ", std::strerror(e));
    if (attempt % hosts.size() == hosts.size() - 1) ::usleep(10000);
  }
}

// Sends `len` bytes on the non-blocking socket `fd` by `deadline`.
void send_by(int fd, const void* data, size_t len, const Deadline& deadline, int peer) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    const ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throw_error(ErrorKind::kPeerFailed, peer, "rank ", peer,
                  " closed the connection before answering its hello: ", std::strerror(errno));
    if (deadline.expired())
      throw_error(ErrorKind::kTimeout, peer, "tcp: rank ", peer,
                  " takes no hello (send timed out)");
    pollfd pfd{fd, POLLOUT, 0};
    ::poll(&pfd, 1, static_cast<int>(deadline.remaining_ms(50)));
  }
}

// Reads `len` bytes from the non-blocking socket `fd` by `deadline`.
void recv_by(int fd, void* data, size_t len, const Deadline& deadline, int peer) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    const ssize_t n = ::recv(fd, p, len, 0);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
      throw_error(ErrorKind::kPeerFailed, peer, "rank ", peer,
                  " closed the connection before answering its hello: ",
                  n == 0 ? "it is exiting, or its port now belongs to another process"
                         : std::strerror(errno));
    if (deadline.expired())
      throw_error(ErrorKind::kTimeout, peer, "tcp: rank ", peer,
                  " did not answer its hello in time (its receiver is stopped or starved)");
    pollfd pfd{fd, POLLIN, 0};
    ::poll(&pfd, 1, static_cast<int>(deadline.remaining_ms(50)));
  }
}

// Says hello on the new connection `fd` to the receiver at `addr` and waits
// for its welcome. On failure a bye goes out before the caller closes `fd`: a
// receiver that is only slow then takes the close for no death of this process.
void introduce(int fd, const PeerAddress& addr, int my_rank, uint32_t my_inc,
               const std::string& secret, const Deadline& deadline) {
  const Frame hello{kHello, static_cast<uint32_t>(kSecretBytes),
                    hello_word(my_inc, addr.incarnation),
                    hello_word(static_cast<uint32_t>(my_rank), static_cast<uint32_t>(addr.rank))};
  Frame welcome{};
  try {
    send_by(fd, &hello, sizeof(hello), deadline, addr.rank);
    send_by(fd, secret.data(), secret.size(), deadline, addr.rank);
    recv_by(fd, &welcome, sizeof(welcome), deadline, addr.rank);
    // Only the receiver this hello addressed welcomes it; anything else (a
    // connection to itself reads its own hello back) is not the peer.
    if (welcome.type != kWelcome || welcome.arg != static_cast<uint64_t>(addr.rank) ||
        welcome.offset != addr.incarnation)
      throw_error(ErrorKind::kPeerFailed, addr.rank, "tcp: the process at ", addr.tcp_host, ":",
                  addr.tcp_port, " is not rank ", addr.rank, " incarnation ", addr.incarnation,
                  " (it answered with a frame of type ", welcome.type, ")");
  } catch (const Error&) {
    const Frame bye{kBye, 0, 0, 0};
    if (::send(fd, &bye, sizeof(bye), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
      // The connection is gone: nothing to tell.
    }
    throw;
  }
}

}  // namespace

std::unique_ptr<PeerLink> tcp_connect(const PeerAddress& addr, int my_rank, uint32_t my_inc,
                                      const std::string& secret, TcpReceiver& receiver,
                                      const Deadline& deadline) {
  check_secret(secret, "tcp");
  UniqueFd fd(tcp_dial(addr, deadline));
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  introduce(fd.get(), addr, my_rank, my_inc, secret, deadline);
  return std::make_unique<TcpLink>(fd.release(), addr.rank, addr.incarnation, addr.segment_bytes,
                                   receiver);
}

void tcp_probe(const PeerAddress& addr, int my_rank, uint32_t my_inc, const std::string& secret,
               const Deadline& deadline) {
  check_secret(secret, "tcp");
  UniqueFd fd(tcp_dial(addr, deadline));
  introduce(fd.get(), addr, my_rank, my_inc, secret, deadline);
  const Frame bye{kBye, 0, 0, 0};
  send_by(fd.get(), &bye, sizeof(bye), deadline, addr.rank);
}

}  // namespace mooncake
