// Any-host transport. Each rank runs one receiver thread (TcpReceiver) that
// accepts its peers' connections and places their writes into the local
// segment, then stores signalled flags and rings the doorbell, in the order
// the frames arrived. A TcpLink is this rank's sending side to one peer.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/link.h"
#include "transport/segment.h"

namespace mooncake {

class TcpReceiver {
 public:
  // Listens on `bind_host` (empty: all interfaces), an ephemeral port.
  TcpReceiver(Segment& segment, int world_capacity, const std::string& bind_host);
  ~TcpReceiver();
  TcpReceiver(const TcpReceiver&) = delete;
  TcpReceiver& operator=(const TcpReceiver&) = delete;

  int port() const { return port_; }
  // True once a connection from `rank` was seen and then closed.
  bool peer_closed(int rank) const { return closed_[rank].load(std::memory_order_acquire); }

 private:
  struct Conn;
  void run();
  bool drain(Conn& c);

  Segment& segment_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd to stop the thread
  int port_ = 0;
  std::unique_ptr<std::atomic<bool>[]> closed_;
  int capacity_;
  std::thread thread_;
};

// Connects to the receiver of the peer at `addr` and introduces this rank.
std::unique_ptr<PeerLink> tcp_connect(const PeerAddress& addr, int my_rank, TcpReceiver& receiver,
                                      const Deadline& deadline);

}  // namespace mooncake
