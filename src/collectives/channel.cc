#include "collectives/channel.h"

#include "core/error.h"
#include "membership/hints.h"

namespace mooncake {

Channels::Channels(Endpoint& endpoint, const Layout& layout, Plane plane, Watch watch,
                   int64_t hang_ms, bool one_bell)
    : endpoint_(endpoint),
      layout_(layout),
      plane_(plane),
      watch_(watch),
      hang_ms_(hang_ms),
      one_bell_(one_bell),
      target_send_gen_(new std::atomic<uint64_t>[static_cast<size_t>(layout.capacity)]),
      target_recv_gen_(new std::atomic<uint64_t>[static_cast<size_t>(layout.capacity)]),
      target_recv_region_(new std::atomic<int>[static_cast<size_t>(layout.capacity)]),
      recv_region_(static_cast<size_t>(layout.capacity), 0),
      send_region_(slot_region(endpoint.incarnation())),
      send_gen_(static_cast<size_t>(layout.capacity), 1),
      recv_gen_(static_cast<size_t>(layout.capacity), 1),
      sent_(static_cast<size_t>(layout.capacity), 0),
      received_(static_cast<size_t>(layout.capacity), 0) {
  for (int p = 0; p < layout.capacity; ++p) {
    target_send_gen_[p].store(1);
    target_recv_gen_[p].store(1);
    target_recv_region_[p].store(0);  // the first processes are incarnation 0
  }
}

void Channels::restart(int peer, uint64_t send_gen, uint64_t recv_gen, uint32_t incarnation) {
  for (uint64_t gen : {send_gen, recv_gen})
    MC_ASSERT(gen > 0 && gen <= kMaxChannelGen, "channel generation ", gen);
  target_send_gen_[peer].store(send_gen, std::memory_order_release);
  // The region before the generation: sync_recv reads them in the other order.
  target_recv_region_[peer].store(slot_region(incarnation), std::memory_order_release);
  target_recv_gen_[peer].store(recv_gen, std::memory_order_release);
}

void Channels::sync_send(int peer) {
  const uint64_t gen = target_send_gen_[peer].load(std::memory_order_acquire);
  if (gen == send_gen_[peer]) return;
  send_gen_[peer] = gen;
  sent_[peer] = 0;
}

void Channels::sync_recv(int peer) {
  const uint64_t gen = target_recv_gen_[peer].load(std::memory_order_acquire);
  if (gen == recv_gen_[peer]) return;
  recv_gen_[peer] = gen;
  recv_region_[peer] = target_recv_region_[peer].load(std::memory_order_acquire);
  received_[peer] = 0;
}

std::string Channels::peer_problem(int p) const {
  if (!endpoint_.alive(p))
    return endpoint_.link(p)
               ? str("rank ", p, " has failed (its process exited or its connection closed)")
               : str("rank ", p, " is not an active member of the group");
  if (hang_ms_ > 0) {
    const int64_t silent = endpoint_.silent_ms(p);
    if (silent >= hang_ms_)
      return str("rank ", p, " is not responding: its heartbeat has stood still for ", silent,
                 " ms (a stopped or hung process; MOONCAKE_HANG_MS=", hang_ms_, ")");
  }
  return {};
}

bool Channels::interrupted(uint64_t alarms) const {
  // A recovery's announcement rings the bells too: without looking at it here
  // a wait on a live peer that is busy recovering slept on until its poll.
  return endpoint_.alarms() != alarms ||
         (watch_ != Watch::kPeer && agreement_called(endpoint_, epoch_));
}

void Channels::check_one(int p, const char* what) {
  const std::string problem = peer_problem(p);
  if (!problem.empty()) throw_error(ErrorKind::kPeerFailed, p, what, ": ", problem);
}

void Channels::check_peer(int peer, const char* what) {
  if (stopping_.load())
    throw_error(ErrorKind::kPeerFailed, -1, what, ": the process group is shutting down");
  check_one(peer, what);
  if (watch_ == Watch::kAnyWatched)
    for (int p : watched_) check_one(p, what);
  // Also without re-runs (kAnyWatched): every member takes part in an
  // agreement that another called (sync_after_failure, deactivate_ranks).
  if (watch_ != Watch::kPeer) {
    if (agreement_called(endpoint_, epoch_))
      throw_error(ErrorKind::kPeerFailed, -1, what, ": the members of epoch ", epoch_,
                  " are agreeing on a new view (a member failed)");
  }
}

void Channels::send(int peer, const MsgHeader& header, const void* payload, size_t len,
                    const Deadline& deadline, const char* what) {
  MC_ASSERT(len <= layout_.chunk_bytes);
  sync_send(peer);
  std::shared_ptr<PeerLink> link = endpoint_.link(peer);
  if (!link) check_one(peer, what);
  const uint64_t m = sent_[peer], gen = send_gen_[peer];
  const uint8_t* base = endpoint_.base();
  const size_t ack = layout_.ack_flag(plane_, peer);
  auto has_slot = [&] { return m - flag_count(load_flag(base, ack), gen) < kSlotsPerChannel; };
  while (!has_slot()) {
    // An alarm (a peer seen gone) ends the wait at once, to look at the peers
    // (here, before each wait: one may have been raised before it began).
    const uint64_t alarms = endpoint_.alarms();
    check_peer(peer, what);
    bool ok = wait_on(
        ack_bell(), [&] { return has_slot() || interrupted(alarms); }, deadline,
        [&] {
          check_peer(peer, what);
          return false;
        });
    if (!ok)
      throw_error(ErrorKind::kTimeout, peer, what, ": timed out waiting for rank ", peer,
                  " to take a message");
  }
  const int me = endpoint_.rank();
  const size_t at = layout_.slot(plane_, me, static_cast<int>(m % kSlotsPerChannel), send_region_);
  MsgHeader h = header;
  h.len = static_cast<uint32_t>(len);
  link->write(at, &h, sizeof(h), deadline);
  link->write(at + sizeof(MsgHeader), payload, len, deadline);
  link->signal(layout_.ready_flag(plane_, me), flag_value(gen, m + 1), data_bell_index(), deadline);
  sent_[peer] = m + 1;
  messages_sent_.fetch_add(1, std::memory_order_relaxed);
}

bool Channels::can_send(int peer) {
  sync_send(peer);
  const uint64_t acked =
      flag_count(load_flag(endpoint_.base(), layout_.ack_flag(plane_, peer)), send_gen_[peer]);
  return sent_[peer] - acked < kSlotsPerChannel;
}

const MsgHeader* Channels::poll(int peer) {
  sync_recv(peer);
  const uint64_t next = received_[peer] + 1;
  uint8_t* base = endpoint_.base();
  if (flag_count(load_flag(base, layout_.ready_flag(plane_, peer)), recv_gen_[peer]) < next)
    return nullptr;
  return reinterpret_cast<const MsgHeader*>(
      base + layout_.slot(plane_, peer, static_cast<int>(received_[peer] % kSlotsPerChannel),
                          recv_region_[peer]));
}

const MsgHeader* Channels::receive(int peer, const Deadline& deadline, const char* what) {
  const MsgHeader* msg = poll(peer);
  // A peer that exited after posting its last message is not a failure:
  // everything it sent arrived before it was seen gone, so look once more.
  // Also after the check: the peer may post and exit between the poll and
  // the check (seen as a failed last op, whose lone survivor took zeros).
  auto look = [&] {
    if (!endpoint_.alive(peer) && (msg = poll(peer)) != nullptr) return true;
    try {
      check_peer(peer, what);
    } catch (const Error&) {
      if ((msg = poll(peer)) != nullptr) return true;
      throw;
    }
    return false;
  };
  while (msg == nullptr) {
    // An alarm (a peer seen gone) ends the wait at once, to look at the peers
    // (here, before each wait: one may have been raised before it began).
    const uint64_t alarms = endpoint_.alarms();
    if (look()) break;
    bool ok = wait_on(
        bell(), [&] { return (msg = poll(peer)) != nullptr || interrupted(alarms); }, deadline,
        look);
    if (!ok) throw_error(ErrorKind::kTimeout, peer, what, ": timed out waiting for rank ", peer);
  }
  return msg;
}

void Channels::release(int peer, const Deadline& deadline) {
  received_[peer] += 1;
  std::shared_ptr<PeerLink> link = endpoint_.link(peer);
  if (!link) return;  // the sender left the group: it needs no ack
  try {
    link->signal(layout_.ack_flag(plane_, endpoint_.rank()),
                 flag_value(recv_gen_[peer], received_[peer]), ack_bell_index(), deadline);
  } catch (const Error& e) {
    // Only the sender needs the ack, to reuse the slot; a sender that is
    // gone needs nothing, and the message itself was received in full.
    if (e.kind() != ErrorKind::kPeerFailed) throw;
  }
}

}  // namespace mooncake
