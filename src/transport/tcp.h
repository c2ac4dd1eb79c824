// Any-host transport. Each rank runs one receiver thread (TcpReceiver) that
// accepts its peers' connections and places their writes into the local
// segment, then stores signalled flags and rings the doorbell, in the order
// the frames arrived (the wire format and its checks: tcp_wire.h). A TcpLink
// is this rank's sending side to one peer.
//
// A connection's first frame is a hello followed by the group's secret (a
// random token every member reads from the store, see Endpoint); nothing
// else is accepted before it. The hello names the process it is for, and the
// receiver answers it with a welcome (tcp_wire.h). A connection that sends
// anything else first, a wrong secret, a frame of unknown type, or a write or
// signal outside the segment is dropped and logged (at most
// kWarningsPerSecond lines a second); the group goes on. At most
// kMaxUnauthenticated connections may wait for their hello, each for at most
// kHelloTimeoutMs; when a new one arrives and the table is full, the one that
// has waited longest is dropped.
//
// The store is the trust boundary: whoever can read it knows the secret and
// is a member (it could, for example, claim a member's slot).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/log.h"
#include "transport/link.h"
#include "transport/segment.h"
#include "transport/tcp_wire.h"

namespace mooncake {

constexpr int kMaxUnauthenticated = 64;
constexpr int64_t kHelloTimeoutMs = 2000;

class TcpReceiver {
 public:
  // Listens on `bind_host` (empty: all interfaces), an ephemeral port, for
  // peers that know `secret` (kSecretBytes bytes) and address this process,
  // incarnation `incarnation` of slot `rank`.
  // `alarm` is bumped whenever a peer's connection closes.
  TcpReceiver(Segment& segment, int world_capacity, int rank, uint32_t incarnation,
              const std::string& bind_host, std::string secret,
              std::atomic<uint64_t>* alarm = nullptr);
  ~TcpReceiver();
  TcpReceiver(const TcpReceiver&) = delete;
  TcpReceiver& operator=(const TcpReceiver&) = delete;

  int port() const { return port_; }
  // True once the connection from incarnation `inc` of slot `rank` was seen
  // and then closed without a goodbye, or a later incarnation of the slot has
  // connected. Only its latest connection counts: a new one clears this, and
  // the close of one it has replaced says nothing. Said once the connections
  // it replaced have been read to their end too (or, still open, have been
  // quiet for kReplacedGraceUs).
  bool peer_closed(int rank, uint32_t inc) const;
  // True once the latest connection from incarnation `inc` of slot `rank` has
  // been read to its end (closed, said goodbye, or dropped), and those it
  // replaced as peer_closed says: all it carried is in place.
  bool read_to_end(int rank, uint32_t inc) const;
  // How long a replaced connection that stays open (its peer's host cut off,
  // or a child process holding the socket) may delay the latest one's end
  // once nothing more is read from the peer.
  static constexpr int64_t kReplacedGraceUs = 2'000'000;
  // When bytes from slot `rank`'s latest incarnation were last read (now_us), 0 before any.
  int64_t last_read_us(int rank) const {
    return peers_[rank].read_us.load(std::memory_order_relaxed);
  }
  // Frames received from incarnation `inc` of slot `rank` (heartbeats included).
  uint64_t frames(int rank, uint32_t inc) const;
  // Connections dropped for breaking the protocol (see the header comment).
  uint64_t rejected() const { return rejected_.load(std::memory_order_relaxed); }

 private:
  struct Conn;
  void run();
  bool drain(Conn& c);
  void drop(Conn& c);

  Segment& segment_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd to stop the thread
  int port_ = 0;
  struct PeerState {
    std::atomic<uint32_t> hello_inc{0};   // 1 + the latest incarnation that said hello
    std::atomic<uint32_t> closed_inc{0};  // 1 + the latest incarnation whose connection closed
    std::atomic<uint32_t> ended_inc{0};   // the same, a goodbye or a drop included
    std::atomic<int64_t> read_us{0};      // when its bytes were last read
    std::atomic<uint64_t> frames{0};      // frames from the latest incarnation
    uint64_t conn = 0;  // receiver thread only: Conn::id of the latest welcomed connection
    // Receiver thread only: welcomed connections of incarnation open_inc - 1
    // not yet dropped, and what the latest one's end said (1 + its
    // incarnation; whether without a goodbye) while an older one of the same
    // incarnation still held bytes to read.
    uint32_t open_inc = 0;
    int open = 0;
    uint32_t ended_pending = 0;
    bool closed_pending = false;
    int64_t pending_us = 0;  // when ended_pending was set
  };
  // Says what a peer's latest connection's end said (ended_pending), once
  // nothing of that incarnation is left to read, or `force`d.
  void settle(PeerState& p, bool force);
  // settle()s each peer whose replaced connections were quiet past kReplacedGraceUs.
  void settle_quiet();
  // Wakes whoever waits on this segment's doorbells, to notice a peer's news.
  void wake_waiters();
  std::unique_ptr<PeerState[]> peers_;
  int capacity_;
  int rank_;
  uint32_t incarnation_;
  const std::string secret_;
  std::atomic<uint64_t> rejected_{0};
  LogLimiter log_limit_{kWarningsPerSecond};  // receiver thread only
  uint64_t hellos_ = 0;                       // receiver thread only: hellos welcomed
  int pending_ = 0;  // receiver thread only: peers whose ended_pending waits
  std::atomic<uint64_t>* alarm_;
  std::thread thread_;
};

// Connects to the receiver of the peer at `addr`, introduces this rank (slot
// `my_rank`, incarnation `my_inc`) with the group's `secret`, and waits for
// the peer's welcome. Throws kTimeout when no connection is made or no
// welcome comes by `deadline`, kPeerFailed when the connection closes before
// the welcome (the process that published `addr` is gone or going, or its
// port now belongs to another process).
std::unique_ptr<PeerLink> tcp_connect(const PeerAddress& addr, int my_rank, uint32_t my_inc,
                                      const std::string& secret, TcpReceiver& receiver,
                                      const Deadline& deadline);

// Whether the process at `addr` answers a connection as tcp_connect's does
// (throws as it does when not); the connection is closed again with a bye, so
// the peer does not take the close for this process's death.
void tcp_probe(const PeerAddress& addr, int my_rank, uint32_t my_inc, const std::string& secret,
               const Deadline& deadline);

}  // namespace mooncake
