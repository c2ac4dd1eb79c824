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
  // `alarm` is bumped whenever a peer's connection closes.
  TcpReceiver(Segment& segment, int world_capacity, const std::string& bind_host,
              std::atomic<uint64_t>* alarm = nullptr);
  ~TcpReceiver();
  TcpReceiver(const TcpReceiver&) = delete;
  TcpReceiver& operator=(const TcpReceiver&) = delete;

  int port() const { return port_; }
  // True once the connection from incarnation `inc` of slot `rank` was seen
  // and then closed, or a later incarnation of the slot has connected.
  bool peer_closed(int rank, uint32_t inc) const;
  // Frames received from incarnation `inc` of slot `rank` (heartbeats included).
  uint64_t frames(int rank, uint32_t inc) const;

 private:
  struct Conn;
  void run();
  bool drain(Conn& c);

  Segment& segment_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd to stop the thread
  int port_ = 0;
  struct PeerState {
    std::atomic<uint32_t> hello_inc{0};   // 1 + the latest incarnation that said hello
    std::atomic<uint32_t> closed_inc{0};  // 1 + the latest incarnation whose connection closed
    std::atomic<uint64_t> frames{0};      // frames from the latest incarnation
  };
  std::unique_ptr<PeerState[]> peers_;
  int capacity_;
  std::atomic<uint64_t>* alarm_;
  std::thread thread_;
};

// Connects to the receiver of the peer at `addr` and introduces this rank
// (slot `my_rank`, incarnation `my_inc`).
std::unique_ptr<PeerLink> tcp_connect(const PeerAddress& addr, int my_rank, uint32_t my_inc,
                                      TcpReceiver& receiver, const Deadline& deadline);

}  // namespace mooncake
