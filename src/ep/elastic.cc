#include "ep/elastic.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/clock.h"
#include "core/comm_config.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/log.h"
#include "core/record.h"
#include "core/wait.h"
#include "membership/hints.h"

namespace mooncake {

namespace {

constexpr uint32_t kElasticMsg = 0xE1A5;  // MsgHeader::op_type of every exchange message

// Polls `ready` (a store read) until it returns true or the deadline passes.
template <typename F>
bool poll_store(const Deadline& deadline, F ready) {
  auto pause = std::chrono::milliseconds(1);
  while (!ready()) {
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  return true;
}

}  // namespace

void ElasticConfig::validate() const {
  MC_CHECK_ARG(capacity >= 1 && capacity <= kMaxCapacity,
               "update_memory_buffers: num_ranks (the capacity) must be in [1, ", kMaxCapacity,
               "], got ", capacity);
  MC_CHECK_ARG(rank >= 0 && rank < capacity, "update_memory_buffers: this rank (", rank,
               ") must be below num_ranks (the capacity, ", capacity, ")");
  MC_CHECK_ARG(local_experts >= 1, "update_memory_buffers: num_experts_per_rank must be >= 1, got ",
               local_experts);
  MC_CHECK_ARG(timeout_ms == -1 || timeout_ms > 0,
               "create_elastic: timeout_ms must be > 0 or -1 (no deadline), got ", timeout_ms);
  MC_CHECK_ARG(metadata_timeout_ms > 0, "create_elastic: metadata_timeout_ms must be > 0, got ",
               metadata_timeout_ms);
  MC_CHECK_ARG(chunk_bytes % 64 == 0, "chunk_bytes must be a multiple of 64, got ", chunk_bytes);
  MC_CHECK_ARG(device_meta.size() <= kMaxDeviceMeta && device_meta != "-" &&
                   std::none_of(device_meta.begin(), device_meta.end(),
                                [](char c) { return c <= ' ' || c > '~'; }),
               "update_memory_buffers: the device metadata must be at most ", kMaxDeviceMeta,
               " printable bytes without spaces, not \"-\"");
}

ElasticPeers::ElasticPeers(const TransferEngine& engine, Store& store, ElasticConfig config)
    : config_(std::move(config)),
      store_(store),
      slots_((config_.validate(), config_.rank), config_.capacity),
      peers_(static_cast<size_t>(config_.capacity)) {
  const CommConfig env = CommConfig::from_env(-1);
  if (config_.chunk_bytes == 0) config_.chunk_bytes = env.chunk_bytes;
  if (config_.hang_ms < 0) config_.hang_ms = env.hang_ms;
  const Layout layout{config_.capacity, config_.chunk_bytes};
  incarnation_ = static_cast<uint32_t>(store_.add(key("inc", config_.rank), 1) - 1);
  endpoint_ = std::make_unique<Endpoint>(engine, store_, config_.prefix, config_.rank, incarnation_,
                                         config_.capacity, layout.total_bytes());
  channels_ = std::make_unique<Channels>(*endpoint_, layout, Plane::kCollective,
                                         Channels::Watch::kPeer, config_.hang_ms,
                                         /*one_bell=*/true);
  publish_meta();
  store_.set(key("cur", config_.rank), std::to_string(incarnation_));
}

ElasticPeers::~ElasticPeers() {
  if (channels_) channels_->set_stopping();
}

std::string ElasticPeers::key(const std::string& what, int slot) const {
  return config_.prefix + what + "/" + std::to_string(slot);
}

std::string ElasticPeers::link_key(int from, int to) const {
  return config_.prefix + "link/" + std::to_string(from) + "/" + std::to_string(to);
}

std::string ElasticPeers::calls_key(int from, int to) const {
  return config_.prefix + "calls/" + std::to_string(from) + "/" + std::to_string(to);
}

void ElasticPeers::publish_meta() {
  store_.set(key("meta", config_.rank) + "/" + std::to_string(incarnation_),
             str(config_.capacity, " ", config_.local_experts, " ",
                 config_.device_meta.empty() ? std::string("-") : config_.device_meta));
}

uint32_t ElasticPeers::attach(int peer, const Deadline& deadline, std::string* device_meta) {
  // The process named by cur/<peer>, once it is alive: right after a death
  // the key still names the dead process until its replacement publishes.
  uint32_t inc = 0;
  bool dead_seen = false, left_seen = false, claimed_seen = false;
  const bool found = poll_store(deadline, [&] {
    if (!store_.check(key("cur", peer))) return false;
    const std::string cur = key("cur", peer);
    RecordReader current(store_.get(cur, 1000), "current incarnation under '" + cur + "'");
    inc = current.number<uint32_t>("incarnation");
    current.end();
    // A newer process has claimed the slot (it publishes cur/<slot> next), or
    // the one named was left out: wait for the replacement, as for a dead one.
    if (store_.add(key("inc", peer), 0) > int64_t{inc} + 1) {
      claimed_seen = true;
      return false;
    }
    if (store_.check(left_key(peer, inc))) {
      left_seen = true;
      return false;
    }
    const std::string meta_key = key("meta", peer) + "/" + std::to_string(inc);
    RecordReader meta(store_.get(meta_key, 1000), "buffer metadata under '" + meta_key + "'");
    const int capacity = meta.number<int>("num_ranks", 1, kMaxCapacity);
    const int local_experts = meta.number<int>("num_experts_per_rank", 1);
    *device_meta = meta.word("device metadata", ElasticConfig::kMaxDeviceMeta);
    if (*device_meta == "-") device_meta->clear();
    meta.end();
    MC_CHECK_ARG(capacity == config_.capacity && local_experts == config_.local_experts,
                 "connect_ranks: rank ", peer, "'s buffer has num_ranks=", capacity,
                 " and num_experts_per_rank=", local_experts, ", this rank's (", config_.rank,
                 ") has num_ranks=", config_.capacity,
                 " and num_experts_per_rank=", config_.local_experts, "; they must be equal");
    try {
      // A short probe: a dead process's port refuses at once, and the store
      // is read again for a replacement.
      endpoint_->connect(peer, inc, deadline.earliest(Deadline::after_ms(200)));
      if (endpoint_->alive(peer)) return true;
    } catch (const Error& e) {
      // A mismatch or a malformed record is not a dead process.
      if (e.kind() == ErrorKind::kInvalidArgument || e.kind() == ErrorKind::kInternal) throw;
    }
    // With a goodbye: should it live after all, it must not take this process
    // for dead when the link closes.
    endpoint_->disconnect(peer, /*farewell=*/true);
    dead_seen = true;
    return false;
  });
  if (!found)
    throw_error(ErrorKind::kTimeout, peer, "connect_ranks: no live process holds rank ", peer,
                " within metadata_timeout_ms (", config_.metadata_timeout_ms,
                " ms): it has not created its buffer (update_memory_buffers)",
                claimed_seen ? ", or a newer process claimed the slot and has not published itself"
                : left_seen  ? str(", or its process (incarnation ", inc,
                                   ") was left out and no replacement has started")
                : dead_seen  ? ", or it died and no replacement has started"
                             : "");
  return inc;
}

void ElasticPeers::check_slot(int peer, const char* what) const {
  MC_CHECK_ARG(peer >= 0 && peer < config_.capacity, what, ": rank ", peer,
               " is outside the capacity [0, ", config_.capacity, ")");
  MC_CHECK_ARG(peer != config_.rank, what, ": rank ", peer, " is this rank itself");
}

void ElasticPeers::check_slots(const std::vector<int>& peers, const char* what) const {
  for (size_t i = 0; i < peers.size(); ++i) {
    check_slot(peers[i], what);
    MC_CHECK_ARG(std::find(peers.begin(), peers.begin() + i, peers[i]) == peers.begin() + i, what,
                 ": rank ", peers[i], " is listed twice");
  }
}

void ElasticPeers::connect(const std::vector<int>& peers, bool activate, uint64_t calls) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  check_member_in_store("connect_ranks");
  check_slots(peers, "connect_ranks");
  for (int p : peers)
    MC_CHECK_ARG(slots_.state(p) == SlotState::kDisconnected, "connect_ranks: rank ", p,
                 " is already ", slot_state_name(slots_.state(p)),
                 "; call disconnect_ranks first to replace it");
  const Deadline deadline = metadata_deadline();
  std::vector<uint32_t> incs;
  std::vector<std::string> metas(peers.size());
  try {
    for (size_t i = 0; i < peers.size(); ++i) incs.push_back(attach(peers[i], deadline, &metas[i]));
  } catch (...) {
    // This process lives: the peers it reached must not take it for dead.
    for (size_t i = 0; i < peers.size(); ++i) endpoint_->disconnect(peers[i], /*farewell=*/true);
    throw;
  }
  for (size_t i = 0; i < peers.size(); ++i) {
    const int p = peers[i];
    const uint64_t gen = publish_send_gen(p, incs[i]);
    std::lock_guard<std::mutex> lock(mu_);
    Peer& peer = peers_[static_cast<size_t>(p)];
    if (peer.inc != incs[i]) peer.last_gen = 0;
    peer.inc = incs[i];
    peer.left_out = false;
    peer.send_gen = gen;
    peer.recv_gen = 0;
    peer.device_meta = std::move(metas[i]);
    slots_.connect(p, false);
    MC_LOG(kInfo, "ep rank ", config_.rank, ": connected rank ", p, " (incarnation ", incs[i],
           ") over ", endpoint_->transport_of(p));
  }
  if (activate)
    for (int p : peers) set_masked_locked(p, false, calls);
}

void ElasticPeers::publish_calls(int peer, uint64_t calls) {
  const Peer& p = peers_[static_cast<size_t>(peer)];
  store_.set(calls_key(config_.rank, peer),
             str(incarnation_, " ", p.inc, " ", p.send_gen, " ", calls));
}

uint64_t ElasticPeers::await_call_count(int64_t timeout_ms) {
  // Which peers to wait for, and on which connection, taken under the lock;
  // the store waits happen without it (a connect may be waiting meanwhile).
  struct Told {
    int slot;
    uint32_t inc;
    uint64_t gen;
  };
  std::vector<Told> wanted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int q = 0; q < config_.capacity; ++q) {
      Peer& p = peers_[static_cast<size_t>(q)];
      if (p.count_pending && slots_.active(q)) wanted.push_back({q, p.inc, p.recv_gen});
      p.count_pending = false;
    }
  }
  const Deadline deadline = timeout_ms < 0 ? metadata_deadline() : Deadline::after_ms(timeout_ms);
  uint64_t highest = 0;
  for (const Told& t : wanted) {
    const std::string k = calls_key(t.slot, config_.rank);
    poll_store(deadline, [&] {
      if (!store_.check(k)) return false;
      RecordReader in(store_.get(k, 1000), "call count under '" + k + "'");
      const uint32_t from = in.number<uint32_t>("from_incarnation");
      const uint32_t to = in.number<uint32_t>("to_incarnation");
      const uint64_t gen = in.number<uint64_t>("generation");
      const uint64_t calls = in.number<uint64_t>("calls");
      in.end();
      // Told on this connection (or this restart of it), not an earlier one.
      if (from != t.inc || to != incarnation_ || gen != t.gen) return false;
      highest = std::max(highest, calls);
      return true;
    });
  }
  return highest;
}

bool ElasticPeers::count_pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::any_of(peers_.begin(), peers_.end(), [](const Peer& p) { return p.count_pending; });
}

void ElasticPeers::set_device_meta(const std::string& meta) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  for (int p = 0; p < config_.capacity; ++p)
    MC_CHECK_ARG(p == config_.rank || slots_.state(p) == SlotState::kDisconnected,
                 "update_memory_buffers: num_rdma_bytes cannot change while rank ", p,
                 " is connected (it mapped this buffer's device workspace); disconnect every "
                 "peer first, or make a new Buffer");
  ElasticConfig c = config_;
  c.device_meta = meta;
  c.validate();
  config_.device_meta = meta;
  publish_meta();
}

std::string ElasticPeers::device_meta(int peer) const {
  check_slot(peer, "device_meta");
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.state(peer) == SlotState::kDisconnected
             ? std::string()
             : peers_[static_cast<size_t>(peer)].device_meta;
}

void ElasticPeers::note_masked(int peer, const std::string& why) {
  check_slot(peer, "note_masked");
  std::lock_guard<std::mutex> lock(mu_);
  mark_failed(peer, why);
}

uint64_t ElasticPeers::publish_send_gen(int peer, uint32_t peer_inc) {
  const int64_t gen = store_.add(config_.prefix + "gens", 1);
  MC_CHECK_ARG(gen >= 1 && static_cast<uint64_t>(gen) <= kMaxChannelGen,
               "connect_ranks: the store's channel generations are used up (", gen,
               "); use a fresh store prefix");
  store_.set(link_key(config_.rank, peer), str(incarnation_, " ", peer_inc, " ", gen));
  return static_cast<uint64_t>(gen);
}

uint64_t ElasticPeers::await_peer_gen(int peer, const Deadline& deadline) {
  // Waits for a generation newer than the last one taken from this process:
  // the peer's side of this connection, or of its restart.
  const Peer& p = peers_[static_cast<size_t>(peer)];
  uint64_t gen = 0;
  const bool found = poll_store(deadline, [&] {
    if (!store_.check(link_key(peer, config_.rank))) return false;
    const std::string link = link_key(peer, config_.rank);
    RecordReader in(store_.get(link, 1000), "channel generation under '" + link + "'");
    const uint32_t from = in.number<uint32_t>("from_incarnation");
    const uint32_t to = in.number<uint32_t>("to_incarnation");
    gen = in.number<uint64_t>("generation", 1, kMaxChannelGen);
    in.end();
    return from == p.inc && to == incarnation_ && gen > p.last_gen;
  });
  if (!found)
    throw_error(ErrorKind::kTimeout, peer, "update_mask_buffer: rank ", peer,
                " has not connected (or, after a mask, published) this rank (", config_.rank,
                ") within metadata_timeout_ms (", config_.metadata_timeout_ms,
                " ms): both sides call connect_ranks and update_mask_buffer");
  return gen;
}

void ElasticPeers::set_masked(int peer, bool masked, uint64_t calls) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  set_masked_locked(peer, masked, calls);
}

void ElasticPeers::set_masked_locked(int peer, bool masked, uint64_t calls) {
  check_slot(peer, "update_mask_buffer");
  MC_CHECK_ARG(slots_.state(peer) != SlotState::kDisconnected, "update_mask_buffer: rank ", peer,
               " is not connected; call connect_ranks first");
  Peer& p = peers_[static_cast<size_t>(peer)];
  if (masked) {
    std::lock_guard<std::mutex> lock(mu_);
    slots_.set_masked(peer, true);
    p.masked_since = true;
    return;
  }
  if (slots_.active(peer)) return;
  check_member_in_store("update_mask_buffer");
  if (peer_left_out(peer))
    throw_error(ErrorKind::kPeerFailed, peer, "update_mask_buffer: rank ", peer,
                "'s process (incarnation ", p.inc,
                ") was left out (gone, or stopped or hung past the hang limit): it can come "
                "back only as a new process; disconnect_ranks([",
                peer, "]), then connect_ranks([", peer, "]) connects its replacement");
  // A new connection, or one masked since its channel restarted: (re)start
  // it with fresh generations on both sides. The store waits happen without
  // mu_, so exchanges among the others go on meanwhile.
  bool restart = p.recv_gen == 0 || p.masked_since;
  if (restart && p.recv_gen != 0) p.send_gen = publish_send_gen(peer, p.inc);
  publish_calls(peer, calls);  // with the generation this side sends with from now on
  const uint64_t gen = restart ? await_peer_gen(peer, metadata_deadline()) : p.recv_gen;
  std::lock_guard<std::mutex> lock(mu_);
  if (restart) {
    p.recv_gen = p.last_gen = gen;
    p.calls = 0;
    p.masked_since = false;
    p.count_pending = true;
    channels_->restart(peer, p.send_gen, p.recv_gen, p.inc);
  }
  slots_.set_masked(peer, false);
}

void ElasticPeers::disconnect(const std::vector<int>& peers) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  check_slots(peers, "disconnect_ranks");
  for (int p : peers)
    MC_CHECK_ARG(slots_.state(p) != SlotState::kDisconnected, "disconnect_ranks: rank ", p,
                 " is not connected");
  std::lock_guard<std::mutex> lock(mu_);  // after any exchange in flight
  for (int p : peers) {
    // A masked peer whose process is lost now was left out, however it was
    // masked (a deadline may have come before the hang limit).
    if (!slots_.active(p) && lost_now(p))
      leave_out(p, str("rank ", p, " was lost when it was disconnected"));
    slots_.disconnect(p);
    peers_[static_cast<size_t>(p)].recv_gen = 0;
    peers_[static_cast<size_t>(p)].masked_since = false;
    endpoint_->disconnect(p, /*farewell=*/true);
  }
}

void ElasticPeers::mark_failed(int peer, const std::string& why) {
  if (!slots_.mark_failed(peer)) return;
  peers_[static_cast<size_t>(peer)].masked_since = true;
  events_.push_back(why);
  MC_LOG(kWarn, "ep rank ", config_.rank, ": masked rank ", peer, ": ", why);
  if (lost_now(peer)) leave_out(peer, why);
}

bool ElasticPeers::lost_now(int peer) const {
  if (!endpoint_->link(peer)) return false;  // not connected: nothing to judge
  if (!endpoint_->alive(peer)) return true;
  return config_.hang_ms > 0 && endpoint_->silent_ms(peer) >= config_.hang_ms;
}

void ElasticPeers::leave_out(int peer, const std::string& why) {
  Peer& p = peers_[static_cast<size_t>(peer)];
  if (p.left_out) return;
  p.left_out = true;
  left_out_peers_.push_back(peer);
  // In the store for the other peers' connects and for the process itself
  // (should the hint not reach it), then in its segment, where its next call
  // looks (best effort: a dead one is skipped).
  try {
    store_.set(left_key(peer, p.inc), str(config_.rank, " ", why));
  } catch (const Error& e) {
    MC_LOG(kWarn, "ep rank ", config_.rank, ": could not record rank ", peer,
           " as left out in the store: ", e.what());
  }
  endpoint_->post_hint(peer, kLeftOutHint, 1);
  if (endpoint_->alive(peer))  // (a dead one's mask said enough)
    MC_LOG(kWarn, "ep rank ", config_.rank, ": left out rank ", peer, " (incarnation ", p.inc,
           "), alive but stopped or hung: it may come back only as a new process");
}

std::string ElasticPeers::left_key(int slot, uint32_t inc) const {
  return config_.prefix + "left/" + std::to_string(slot) + "/" + std::to_string(inc);
}

uint32_t ElasticPeers::incarnation_of(int peer) const {
  check_slot(peer, "incarnation_of");
  std::lock_guard<std::mutex> lock(mu_);
  MC_CHECK_ARG(slots_.state(peer) != SlotState::kDisconnected, "incarnation_of: rank ", peer,
               " is not connected");
  return peers_[static_cast<size_t>(peer)].inc;
}

bool ElasticPeers::left_out() const {
  return left_out_.load(std::memory_order_acquire) || endpoint_->hint(kLeftOutHint) != 0;
}

void ElasticPeers::check_member(const char* what) const {
  if (left_out()) throw_left_out(what);
}

void ElasticPeers::check_member_in_store(const char* what) {
  check_member(what);
  if (store_.check(left_key(config_.rank, incarnation_))) {
    left_out_.store(true, std::memory_order_release);
    throw_left_out(what);
  }
}

void ElasticPeers::throw_left_out(const char* what) const {
  throw_error(ErrorKind::kLeftOut, config_.rank, what, ": rank ", config_.rank, " (incarnation ",
              incarnation_,
              ") was left out by its peers: they found its process stopped, hung or gone past "
              "the hang limit (MOONCAKE_HANG_MS) and went on without it. This buffer sends "
              "nothing more; the slot can come back only as a new incarnation (a new "
              "Buffer.create_elastic and update_memory_buffers, which the peers connect after "
              "disconnect_ranks)");
}

bool ElasticPeers::peer_left_out(int peer) const {
  check_slot(peer, "peer_left_out");
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.state(peer) != SlotState::kDisconnected &&
         peers_[static_cast<size_t>(peer)].left_out;
}

std::vector<int> ElasticPeers::take_left_out() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(left_out_peers_, {});
}

std::vector<uint8_t> ElasticPeers::exchange(const void* const* send, const size_t* send_bytes,
                                            void* const* recv, const size_t* recv_bytes, int bound,
                                            int64_t timeout_ms) {
  return run_exchange(send, send_bytes, recv, recv_bytes, bound, timeout_ms, nullptr);
}

void ElasticPeers::reject(const std::string& reason, int64_t timeout_ms) {
  MC_CHECK_ARG(!reason.empty(), "reject: reason must not be empty");
  const size_t n = static_cast<size_t>(config_.capacity);
  std::vector<const void*> send(n, nullptr);
  std::vector<void*> recv(n, nullptr);
  std::vector<size_t> bytes(n, 0);
  run_exchange(send.data(), bytes.data(), recv.data(), bytes.data(), slots_.rank_bound(),
               timeout_ms, &reason);
}

std::vector<std::pair<int, std::string>> ElasticPeers::rejections() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rejections_;
}

std::vector<uint8_t> ElasticPeers::run_exchange(const void* const* send, const size_t* send_bytes,
                                                void* const* recv, const size_t* recv_bytes,
                                                int bound, int64_t timeout_ms,
                                                const std::string* reject) {
  check_member("ep exchange");
  std::lock_guard<std::mutex> lock(mu_);
  rejections_.clear();
  const int me = config_.rank;
  MC_CHECK_ARG(bound > me && bound <= config_.capacity, "exchange: bound must be in (", me, ", ",
               config_.capacity, "], got ", bound);
  std::vector<uint8_t> got(static_cast<size_t>(config_.capacity), 0);
  got[static_cast<size_t>(me)] = 1;
  if (!reject && send_bytes[me] != 0 && send[me] != recv[me])
    std::memmove(recv[me], send[me], std::min(send_bytes[me], recv_bytes[me]));
  const size_t chunk = config_.chunk_bytes;
  // A rejection is one piece to each peer, carrying the reason (cut to a piece).
  const std::string why = reject ? reject->substr(0, chunk) : std::string();
  const int64_t limit_ms = timeout_ms < 0 ? config_.timeout_ms : timeout_ms;
  const Deadline deadline = Deadline::after_ms(limit_ms);
  // One stream per active peer: its pieces out and its pieces in. Every
  // message has at least one piece (it carries the header).
  struct Stream {
    int peer;
    uint64_t call;
    size_t to_send, sent = 0, to_recv, received = 0;
    bool failed = false;
    bool done() const { return failed || (sent == to_send && received == to_recv); }
  };
  std::vector<Stream> streams;
  for (int i = 1; i < bound; ++i) {
    const int p = (me + i) % bound;  // start after this rank: not everyone hits rank 0 first
    if (!slots_.active(p)) continue;
    const uint64_t call = ++peers_[static_cast<size_t>(p)].calls;
    // Rejecting, what the peer sends is learnt from its first piece.
    streams.push_back({p, call, reject ? 1 : num_pieces(send_bytes[p], chunk), 0,
                       reject ? 1 : num_pieces(recv_bytes[p], chunk), 0, false});
  }
  auto fail = [&](Stream& s, const std::string& why) {
    s.failed = true;
    mark_failed(s.peer, why);
  };
  // Moves what can move without waiting; true when something did.
  auto step = [&](Stream& s) {
    const int p = s.peer;
    bool moved = false;
    try {
      while (!s.failed && s.sent < s.to_send && channels_->can_send(p)) {
        MsgHeader h{};
        h.op_type = kElasticMsg;
        h.op_seq = s.call;
        if (reject) {
          h.flags = kMsgRejected;
          channels_->send(p, h, why.data(), why.size(), deadline, "ep exchange");
          ++s.sent;
          moved = true;
          continue;
        }
        h.edge_bytes = send_bytes[p];
        h.edge_expect = recv_bytes[p];
        const size_t len = piece_bytes(send_bytes[p], chunk, s.sent);
        channels_->send(p, h, static_cast<const uint8_t*>(send[p]) + s.sent * chunk, len, deadline,
                        "ep exchange");
        ++s.sent;
        moved = true;
      }
      const MsgHeader* msg = nullptr;
      while (!s.failed && s.received < s.to_recv && (msg = channels_->poll(p)) != nullptr) {
        moved = true;
        if (msg->op_seq < s.call) {  // late, from an exchange this side gave up on
          channels_->release(p, deadline);
          continue;
        }
        if (msg->op_type == kElasticMsg && msg->op_seq == s.call && s.received == 0 &&
            (msg->flags & kMsgRejected) != 0) {  // the peer takes its part by rejecting
          rejections_.emplace_back(p,
                                   std::string(reinterpret_cast<const char*>(msg + 1), msg->len));
          channels_->release(p, deadline);
          s.received = s.to_recv;
          continue;
        }
        if (reject && msg->op_type == kElasticMsg && msg->op_seq == s.call) {
          // Rejecting: drain the peer's message, however long it says it is.
          if (s.received == 0) s.to_recv = num_pieces(msg->edge_bytes, chunk);
          channels_->release(p, deadline);
          ++s.received;
          continue;
        }
        const size_t len = piece_bytes(recv_bytes[p], chunk, s.received);
        if (msg->op_type != kElasticMsg || msg->op_seq != s.call) {
          fail(s, str("rank ", p, " is out of step: its message is for call ", msg->op_seq,
                      ", this rank is at call ", s.call,
                      " (a mask on one side only; publish or reconnect it on both sides)"));
        } else if (s.received == 0 &&
                   (msg->edge_bytes != recv_bytes[p] || msg->edge_expect != send_bytes[p])) {
          fail(s,
               str("rank ", p, " sends ", msg->edge_bytes, " bytes and expects ", msg->edge_expect,
                   "; this rank expects ", recv_bytes[p], " and sends ", send_bytes[p]));
        } else if (msg->len != len) {
          fail(s, str("rank ", p, " sent a piece of ", msg->len, " bytes, expected ", len));
        } else {
          if (len != 0)
            std::memcpy(static_cast<uint8_t*>(recv[p]) + s.received * chunk, msg + 1, len);
          channels_->release(p, deadline);
          ++s.received;
        }
      }
    } catch (const Error& e) {
      if (!e.peer_or_timeout()) throw;
      fail(s, e.what());
      moved = true;  // a stream that ended: not a reason to wait (over tcp, a closed link
                     // throws here, and the wait below would sleep to the deadline)
    }
    return moved;
  };
  auto look = [&] {               // fails the unfinished streams of peers that are gone or hung
    check_member("ep exchange");  // the hint rings the bells: a wait ends at once
    bool any = false;
    for (Stream& s : streams) {
      if (s.done()) continue;
      const std::string problem = channels_->peer_problem(s.peer);
      if (!problem.empty()) {
        // It may have posted its last piece and exited since `step` looked:
        // all it sent before it went is here now, and may complete the stream.
        step(s);
        if (!s.done()) fail(s, str("ep exchange: ", problem));
        any = true;
      }
    }
    return any;
  };
  auto unfinished = [&] {
    return std::any_of(streams.begin(), streams.end(), [](const Stream& s) { return !s.done(); });
  };
  // This process stood still past the hang limit (stopped, since its last
  // exchange or inside this one): its peers may have left it out, and over
  // tcp their hint may still wait in a socket. The store says so before it
  // sends again: a resumed process's late message would overwrite a flag of
  // its replacement's channel (it reads as zero there, but stalls the pair).
  auto awake = [&, last = last_exchange_us_]() mutable {
    const int64_t now = now_us();
    if (config_.hang_ms > 0 && now - last > config_.hang_ms * 1000)
      check_member_in_store("ep exchange");
    last = now;
  };
  while (unfinished()) {
    awake();
    bool moved = false;
    for (Stream& s : streams)
      if (!s.done()) moved |= step(s);
    if (moved || look()) continue;
    const uint64_t alarms = endpoint_->alarms();
    auto ready = [&] {
      if (endpoint_->alarms() != alarms) return true;
      for (Stream& s : streams) {
        if (s.done()) continue;
        if ((s.sent < s.to_send && channels_->can_send(s.peer)) ||
            (s.received < s.to_recv && channels_->poll(s.peer) != nullptr))
          return true;
      }
      return false;
    };
    // False also when `look` failed a stream and nothing else is ready.
    if (!wait_on(channels_->bell(), ready, deadline, look) && deadline.expired()) {
      for (Stream& s : streams)
        if (!s.done())
          fail(s, str("ep exchange: timed out waiting for rank ", s.peer,
                      s.received < s.to_recv ? " to send" : " to take a message", " (deadline ",
                      limit_ms, " ms)"));
    }
  }
  last_exchange_us_ = now_us();
  bool failed = false;
  for (const Stream& s : streams) {
    if (!s.failed) got[static_cast<size_t>(s.peer)] = 1;
    failed |= s.failed;
  }
  // Peers that stopped answering this process may have left it out, with a
  // hint that has not arrived (over tcp, queued while it was stopped).
  if (failed) check_member_in_store("ep exchange");
  return got;
}

std::vector<uint8_t> ElasticPeers::barrier(int64_t timeout_ms) {
  const size_t n = static_cast<size_t>(config_.capacity);
  std::vector<const void*> send(n, nullptr);
  std::vector<void*> recv(n, nullptr);
  std::vector<size_t> bytes(n, 0);
  return exchange(send.data(), bytes.data(), recv.data(), bytes.data(), slots_.rank_bound(),
                  timeout_ms);
}

uint64_t ElasticPeers::watch_peers(Endpoint::LossListener fn) {
  return endpoint_->watch_peers(std::move(fn), config_.hang_ms);
}

const char* ElasticPeers::transport_of(int peer) const {
  return endpoint_->transport_of(peer);
}

std::vector<std::string> ElasticPeers::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

}  // namespace mooncake
