// Flow-controlled message channels over the transport: for each plane and
// peer, up to kSlotsPerChannel messages in flight. A sender waits for a free
// slot (the receiver's ack), writes header + payload into the peer's slot and
// signals the peer's ready flag; a receiver waits for its ready flag, reads
// the message in place and acks it. Counters are monotonic for the life of
// the group, so no message of one op can be mistaken for another's.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "collectives/layout.h"
#include "core/clock.h"
#include "transport/engine.h"

namespace mooncake {

class Channels {
 public:
  Channels(Endpoint& endpoint, const Layout& layout, Plane plane);

  // Sends one message (len <= chunk_bytes) to `peer`. `what` names the op for errors.
  void send(int peer, const MsgHeader& header, const void* payload, size_t len,
            const Deadline& deadline, const char* what);
  // Waits for the next message from `peer` and returns it in place. The
  // payload follows the header. Valid until release(peer).
  const MsgHeader* receive(int peer, const Deadline& deadline, const char* what);
  // Non-blocking: the next message from `peer`, or nullptr.
  const MsgHeader* poll(int peer);
  void release(int peer, const Deadline& deadline);

  // Set when the group shuts down: blocked waits return with an error.
  void set_stopping() {
    stopping_.store(true);
    ring(bell());
    ring(ack_bell());
  }
  // Rung when a message arrives on this plane.
  Doorbell* bell() const { return endpoint_.bell(data_bell_index()); }
  // Rung when a peer takes one of our messages (frees a slot). Apart from the
  // data bell so that a rank waiting for data is not woken by acks.
  Doorbell* ack_bell() const { return endpoint_.bell(ack_bell_index()); }
  Endpoint& endpoint() { return endpoint_; }
  const Layout& layout() const { return layout_; }

  // Throws a PeerFailed error if any rank (`peer` first) is gone, or the
  // group is stopping.
  void check_peer(int peer, const char* what);

 private:
  int data_bell_index() const { return static_cast<int>(plane_); }
  int ack_bell_index() const { return kNumPlanes + static_cast<int>(plane_); }

  Endpoint& endpoint_;
  Layout layout_;
  Plane plane_;
  std::vector<uint64_t> sent_;      // messages sent to each peer
  std::vector<uint64_t> received_;  // messages consumed from each peer
  std::atomic<bool> stopping_{false};
};

}  // namespace mooncake
