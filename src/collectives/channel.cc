#include "collectives/channel.h"

#include "core/error.h"

namespace mooncake {

Channels::Channels(Endpoint& endpoint, const Layout& layout, Plane plane)
    : endpoint_(endpoint),
      layout_(layout),
      plane_(plane),
      sent_(static_cast<size_t>(layout.capacity), 0),
      received_(static_cast<size_t>(layout.capacity), 0) {}

void Channels::check_peer(int peer, const char* what) {
  if (stopping_.load())
    throw_error(ErrorKind::kPeerFailed, -1, what, ": the process group is shutting down");
  // Every rank, not only the one awaited: a peer that waits on a dead rank
  // stops sending to us too, so any death dooms the op.
  for (int i = 0; i < endpoint_.size(); ++i) {
    int p = (peer + i) % endpoint_.size();
    if (!endpoint_.alive(p))
      throw_error(ErrorKind::kPeerFailed, p, what, ": rank ", p,
                  " has failed (its process exited or its connection closed)");
  }
}

void Channels::send(int peer, const MsgHeader& header, const void* payload, size_t len,
                    const Deadline& deadline, const char* what) {
  MC_ASSERT(len <= layout_.chunk_bytes);
  const uint64_t m = sent_[peer];
  const uint8_t* base = endpoint_.base();
  const size_t ack = layout_.ack_flag(plane_, peer);
  auto has_slot = [&] { return m - load_flag(base, ack) < kSlotsPerChannel; };
  if (!has_slot()) {
    bool ok = wait_on(ack_bell(), has_slot, deadline, [&] {
      check_peer(peer, what);
      return false;
    });
    if (!ok)
      throw_error(ErrorKind::kTimeout, peer, what, ": timed out waiting for rank ", peer,
                  " to take a message");
  }
  const int me = endpoint_.rank();
  const size_t at = layout_.slot(plane_, me, static_cast<int>(m % kSlotsPerChannel));
  PeerLink& link = endpoint_.link(peer);
  MsgHeader h = header;
  h.len = static_cast<uint32_t>(len);
  link.write(at, &h, sizeof(h), deadline);
  link.write(at + sizeof(MsgHeader), payload, len, deadline);
  link.signal(layout_.ready_flag(plane_, me), m + 1, data_bell_index(), deadline);
  sent_[peer] = m + 1;
}

const MsgHeader* Channels::poll(int peer) {
  const uint64_t next = received_[peer] + 1;
  uint8_t* base = endpoint_.base();
  if (load_flag(base, layout_.ready_flag(plane_, peer)) < next) return nullptr;
  return reinterpret_cast<const MsgHeader*>(
      base + layout_.slot(plane_, peer, static_cast<int>(received_[peer] % kSlotsPerChannel)));
}

const MsgHeader* Channels::receive(int peer, const Deadline& deadline, const char* what) {
  const MsgHeader* msg = poll(peer);
  if (msg != nullptr) return msg;
  bool ok = wait_on(
      bell(), [&] { return (msg = poll(peer)) != nullptr; }, deadline,
      [&] {
        // A peer that exited after posting its last message is not a failure:
        // everything it sent arrived before it was seen gone, so look once more.
        if (!endpoint_.alive(peer) && (msg = poll(peer)) != nullptr) return true;
        check_peer(peer, what);
        return false;
      });
  if (!ok) throw_error(ErrorKind::kTimeout, peer, what, ": timed out waiting for rank ", peer);
  return msg;
}

void Channels::release(int peer, const Deadline& deadline) {
  received_[peer] += 1;
  try {
    endpoint_.link(peer).signal(layout_.ack_flag(plane_, endpoint_.rank()), received_[peer],
                                ack_bell_index(), deadline);
  } catch (const Error& e) {
    // Only the sender needs the ack, to reuse the slot; a sender that is
    // gone needs nothing, and the message itself was received in full.
    if (e.kind() != ErrorKind::kPeerFailed) throw;
  }
}

}  // namespace mooncake
