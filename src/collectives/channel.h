// Flow-controlled message channels over the transport: for each plane and
// peer, up to kSlotsPerChannel messages in flight. A sender waits for a free
// slot (the receiver's ack), writes header + payload into the peer's slot and
// signals the peer's ready flag; a receiver waits for its ready flag, reads
// the message in place and acks it.
//
// Counters restart when the membership changes. Every flag value carries the
// generation it was written in (high bits) and its count (low bits), and a
// flag of another generation reads as zero, so a late write of an abandoned
// op, or of a slot's previous process, is never mistaken for a new message.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "collectives/layout.h"
#include "core/clock.h"
#include "transport/engine.h"

namespace mooncake {

constexpr int kFlagCountBits = 40;
constexpr uint64_t kMaxChannelGen = (uint64_t{1} << (64 - kFlagCountBits)) - 1;
inline uint64_t flag_value(uint64_t gen, uint64_t count) {
  return (gen << kFlagCountBits) | count;
}
// The count a flag holds for generation `gen` (0 if it was written in another).
inline uint64_t flag_count(uint64_t value, uint64_t gen) {
  return (value >> kFlagCountBits) == gen ? value & ((uint64_t{1} << kFlagCountBits) - 1) : 0;
}

class Channels {
 public:
  // Which failures end a wait:
  //  * kPeer: the peer waited on is gone (p2p);
  //  * kPeerOrEpoch: that, or a peer told of a later epoch (collectives that
  //    recover: a peer that waits on a dead rank abandons the op and says
  //    so, while a rank that exited after sending all its messages is no
  //    reason to stop);
  //  * kAnyWatched: any watched rank is gone (collectives that fail fast),
  //    or a peer told of a later epoch.
  // A rank whose heartbeat stood still for `hang_ms` (> 0) counts as failed.
  enum class Watch { kPeer, kPeerOrEpoch, kAnyWatched };
  // `one_bell`: acks ring the data bell too, so one wait sees both (for a
  // sender and receiver of many peers at once that waits on whichever moves).
  Channels(Endpoint& endpoint, const Layout& layout, Plane plane, Watch watch, int64_t hang_ms,
           bool one_bell = false);

  // Restarts both directions of the channel to `peer` at generation `gen`,
  // `peer` now being the process of incarnation `incarnation` (its messages
  // land in that incarnation's slot region). Safe from any thread: the
  // sending and receiving threads pick it up at their next use of the channel.
  void restart(int peer, uint64_t gen, uint32_t incarnation) {
    restart(peer, gen, gen, incarnation);
  }
  // The same with a generation per direction: `send_gen` for our messages to
  // `peer`, `recv_gen` for its messages to us (each chosen by its sender).
  void restart(int peer, uint64_t send_gen, uint64_t recv_gen, uint32_t incarnation);
  // The ranks whose death fails a wait with kAnyWatched (set by the thread
  // that runs the collectives).
  // `epoch` is the view's: a wait fails once a peer tells of a later one.
  void set_watched(std::vector<int> ranks, uint64_t epoch) {
    watched_ = std::move(ranks);
    epoch_ = epoch;
  }

  // Sends one message (len <= chunk_bytes) to `peer`. `what` names the op for errors.
  void send(int peer, const MsgHeader& header, const void* payload, size_t len,
            const Deadline& deadline, const char* what);
  // Messages sent so far on this plane, to every peer (tests count rounds).
  uint64_t messages_sent() const { return messages_sent_.load(std::memory_order_relaxed); }
  // True when a send to `peer` would not wait for a free slot.
  bool can_send(int peer);
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
  // A PeerFailed error if `peer` is gone or silent past the hang limit; empty if not.
  std::string peer_problem(int peer) const;

  // Throws a PeerFailed error if `peer` (or, see Watch, another rank) is
  // gone, or the group is stopping.
  void check_peer(int peer, const char* what);

 private:
  int data_bell_index() const { return static_cast<int>(plane_); }
  int ack_bell_index() const {
    return one_bell_ ? data_bell_index() : kNumPlanes + static_cast<int>(plane_);
  }
  void check_one(int p, const char* what);
  // Whether a wait that began at `alarms` should stop to look at its peers: a
  // peer was seen gone, or (kPeerOrEpoch) a recovery of this epoch was called.
  bool interrupted(uint64_t alarms) const;
  // Applies a pending restart to one direction of the channel to `peer`.
  void sync_send(int peer);
  void sync_recv(int peer);

  Endpoint& endpoint_;
  Layout layout_;
  Plane plane_;
  Watch watch_;
  int64_t hang_ms_;
  bool one_bell_;
  std::vector<int> watched_;
  uint64_t epoch_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> target_send_gen_;  // per peer
  std::unique_ptr<std::atomic<uint64_t>[]> target_recv_gen_;  // per peer
  std::unique_ptr<std::atomic<int>[]> target_recv_region_;    // per peer
  std::vector<int> recv_region_;               // the slot region each peer's messages land in
  int send_region_;                            // ours, in the peers' segments
  std::vector<uint64_t> send_gen_, recv_gen_;  // generation each side runs in
  std::vector<uint64_t> sent_;                 // messages sent to each peer in send_gen_
  std::vector<uint64_t> received_;             // messages consumed from each peer in recv_gen_
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> messages_sent_{0};
};

}  // namespace mooncake
