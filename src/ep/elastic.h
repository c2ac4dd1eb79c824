// The elastic EP buffer's peers (upstream's elastic EP buffer design):
// one Endpoint whose slot is this process's logical rank, a SlotTable, and
// message channels to the connected slots. Peers find each other through the
// caller's store; there is no process group and no agreement: every rank
// keeps its own mask, and a peer that stays silent past an exchange's deadline
// is masked on the side that waited for it. Every exchange has the whole
// timeout from its own start: a call of several exchanges (a dispatch: counts,
// then tokens) never hands a later one what an earlier one left, so a peer
// that answered the counts is not masked because another peer was silent.
//
// Store keys (under `prefix`):
//   inc/<slot>              counter: the incarnation of each process that holds the slot
//   cur/<slot>              "<inc>": the process holding the slot now
//   meta/<slot>/<inc>       "<capacity> <local experts> <device meta>": checked at
//                           connect; the device meta ("-": none) is what a device
//                           path needs to map the process's workspace
//   addr/<slot>/<inc>       the Endpoint's address (transport/engine.h)
//   link/<from>/<to>        "<from inc> <to inc> <gen>": the channel generation `from`
//                           sends with on its latest connection to `to`
//   gens                    counter: channel generations, unique in the store
//   calls/<from>/<to>       "<from inc> <to inc> <gen> <calls>": the caller's call
//                           count when `from` last published `to`, with the
//                           generation it sends with since (see await_call_count)
//   left/<slot>/<inc>       "<by> <why>": process <inc> of the slot was left out
//
// Left out: a peer masked while the transport sees its process gone, or its
// heartbeat still past the hang limit (a stopped or hung process), is left
// out for good, as a process group leaves such a rank out: it may come back
// only as a new process (a new incarnation of its slot). The side that sees
// it records that in the store and posts it into the process's segment (the
// left-out hint, membership/hints.h). Connecting never takes a left-out
// process, nor one whose slot a newer process has claimed: connect waits for
// the replacement, as for a dead process (a stopped one is alive and still
// named by cur/<slot>, and was taken: every side then timed out publishing).
// A left-out process that resumes gets a kLeftOut error from its next call
// (check_member: the hint, one load; admin calls and failed exchanges also
// read the store, in case the hint never reached it), before it sends.
//
// Connecting is one-sided and never waits for the peer to connect back: it
// maps the peer's segment (waiting for its address up to the metadata
// timeout) and publishes the generation this side will send with. Activating
// a staged peer (set_masked(peer, false)) waits for the peer's own link key
// for this pair of processes, then restarts the channel in both directions.
// A flag of another generation reads as zero (collectives/channel.h), so a
// late write of an old connection, or of the process a replacement took over
// from, never reaches a new one.
//
// Publishing a peer again after it was masked (by set_masked(peer, true) or
// a failed exchange) restarts the connection the same way: both sides draw
// fresh generations, so nothing queued while one side had the other masked
// is read afterwards. Both sides publish (or reconnect) for that.
//
// Every message of an exchange carries the pair's call number (both sides
// count the exchanges they run with each other since the channel restarted);
// a message with an older number is a late one from an exchange this side
// gave up on, and is dropped; a newer one means the pair is out of step, and
// the peer is masked.
//
// An exchange moves every peer's messages independently (one wait on a bell
// that both messages and acks ring): a silent peer holds up only its own
// stream, and at the deadline only the peers whose streams are unfinished are
// masked.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "collectives/channel.h"
#include "collectives/layout.h"
#include "ep/slots.h"
#include "store/store.h"
#include "transport/engine.h"

namespace mooncake {

struct ElasticConfig {
  int rank = 0;
  int capacity = 0;
  int local_experts = 0;                 // num_experts_per_rank; peers must agree
  int64_t timeout_ms = 30000;            // each exchange (communication only); < 0: none
  int64_t metadata_timeout_ms = 300000;  // store waits only
  size_t chunk_bytes = 0;                // 0: MOONCAKE_CHUNK_BYTES
  int64_t hang_ms = -1;  // silence that fails a peer; 0: never; < 0: MOONCAKE_HANG_MS
  std::string prefix = "mooncake-ep/";  // store key namespace
  // Published with the metadata for peers' device paths (an opaque word: no
  // whitespace, at most kMaxDeviceMeta bytes); empty: none.
  std::string device_meta;
  static constexpr size_t kMaxDeviceMeta = 1024;

  // Throws an invalid-argument Error naming the field that breaks its rule.
  void validate() const;
};

class ElasticPeers {
 public:
  ElasticPeers(const TransferEngine& engine, Store& store, ElasticConfig config);
  ~ElasticPeers();
  ElasticPeers(const ElasticPeers&) = delete;
  ElasticPeers& operator=(const ElasticPeers&) = delete;

  const ElasticConfig& config() const { return config_; }
  const SlotTable& slots() const { return slots_; }
  uint32_t incarnation() const { return incarnation_; }
  // The incarnation of the process a connected peer's slot is connected to
  // (throws for a disconnected slot): a device path tags what it expects from
  // that slot with it.
  uint32_t incarnation_of(int peer) const;

  // Whether the peers left this process out (see "Left out" above): one load.
  bool left_out() const;
  // Throws kLeftOut (naming `what`) when they did.
  void check_member(const char* what) const;
  // Whether this side left out the process connected in `peer`'s slot.
  bool peer_left_out(int peer) const;
  // The slots whose processes this side left out since the last call: a
  // device path fences their workspaces before it lets their mappings go.
  std::vector<int> take_left_out();

  // Connects to the process that holds each slot; all or nothing: when one
  // fails (bad argument, refused, timed out), no slot changes. While the
  // process the store names for a slot is gone, waits for its replacement.
  // activate=false stages it (masked); activate=true publishes it at once.
  // `calls`: the caller's call count, published with each peer it publishes.
  void connect(const std::vector<int>& peers, bool activate, uint64_t calls = 0);
  // masked=false publishes a staged peer (see the header comment) and tells it
  // `calls`; masked=true masks an active one. Idempotent.
  void set_masked(int peer, bool masked, uint64_t calls = 0);
  // A device path tags its signals with the caller's call count, which peers
  // must share. Peers that ran calls without each other (one masked, or a
  // new process) count differently: when a peer is (re)published, both sides
  // tell their count, and before its next call each side moves up to the
  // highest (every process that takes part in a call counts it). Returns the
  // highest count told by the peers published since the last call, waiting
  // up to timeout_ms (< 0: the metadata timeout) for each one's; a peer that
  // has not told by then (it has not published this process) is left out;
  // 0 when none has.
  uint64_t await_call_count(int64_t timeout_ms);
  // Whether a peer was published since the last await_call_count.
  bool count_pending() const;
  // Replaces this process's device meta in the store (a reallocated device
  // workspace). Only while no peer is connected: connected peers mapped the
  // old one.
  void set_device_meta(const std::string& meta);
  // The device meta of a connected peer's process ("" when it has none).
  std::string device_meta(int peer) const;
  // A device path found the peer silent past a deadline and masked it there:
  // it is masked here too (publishing it again restarts the connection).
  void note_masked(int peer, const std::string& why);
  // Releases the connections (staged or active).
  void disconnect(const std::vector<int>& peers);

  // One exchange among the active slots below `bound`: send[p] (send_bytes[p]
  // bytes) to every such peer p and receive recv_bytes[p] bytes into recv[p]
  // from it (arrays of capacity entries; this rank's own entry is copied).
  // A peer that fails, stays silent past timeout_ms from this exchange's start
  // (< 0: the configured one) or sends the wrong number of bytes is masked.
  // Returns, per slot, 1 when its data arrived (this rank included) or it
  // rejected the exchange (see reject(): nothing of it is written then).
  std::vector<uint8_t> exchange(const void* const* send, const size_t* send_bytes,
                                void* const* recv, const size_t* recv_bytes, int bound,
                                int64_t timeout_ms);
  // Takes this rank's part in an exchange among the active slots (below the
  // rank bound) without its data: each peer gets `reason` instead of its
  // messages and finds it in rejections() after its exchange, as it would
  // an error of its own (for what this rank alone can see, such as a peer's
  // corrupt counts); what the peers send here is drained.
  void reject(const std::string& reason, int64_t timeout_ms);
  // (slot, reason) of the peers that rejected the last exchange.
  std::vector<std::pair<int, std::string>> rejections() const;
  // An exchange of empty messages among all active slots (one phase: one
  // timeout_ms).
  std::vector<uint8_t> barrier(int64_t timeout_ms);

  // "shm", "tcp", "self" or "none".
  const char* transport_of(int peer) const;
  // Why peers were masked by exchanges so far (one line each), oldest first.
  std::vector<std::string> events() const;
  // Endpoint::watch_peers of this process's endpoint, with the hang limit.
  uint64_t watch_peers(Endpoint::LossListener fn);

 private:
  struct Peer {
    uint32_t inc = 0;            // the process connected to (valid while connected)
    bool left_out = false;       // process `inc` was left out (by this side or another)
    uint64_t send_gen = 0;       // ours on this connection, chosen at connect
    uint64_t recv_gen = 0;       // the peer's on this connection (0: not yet published)
    uint64_t last_gen = 0;       // the newest peer generation taken from process `inc`
    uint64_t calls = 0;          // exchanges with it since the channel restarted
    bool masked_since = false;   // masked since the channel restarted: publishing restarts it
    std::string device_meta;     // of process `inc`
    bool count_pending = false;  // published since the last await_call_count
  };
  std::string key(const std::string& what, int slot) const;
  std::string link_key(int from, int to) const;
  std::string calls_key(int from, int to) const;
  // Writes meta/<slot>/<inc> from the config.
  void publish_meta();
  // Connects to the live process that holds `peer` and returns its
  // incarnation: waits for a replacement while the one the store names is
  // gone; checks that its capacity and local experts match ours.
  uint32_t attach(int peer, const Deadline& deadline, std::string* device_meta);
  void publish_calls(int peer, uint64_t calls);
  // Draws a fresh generation for our messages to `peer` and publishes it.
  uint64_t publish_send_gen(int peer, uint32_t peer_inc);
  // Waits for the peer's generation of this connection (admin_mu_ held).
  uint64_t await_peer_gen(int peer, const Deadline& deadline);
  std::string left_key(int slot, uint32_t inc) const;
  void mark_failed(int peer, const std::string& why);  // mu_ held
  // Whether the transport sees `peer`'s process gone, or its heartbeat still
  // past the hang limit.
  bool lost_now(int peer) const;
  // Leaves the connected process of `peer` out (see "Left out"); mu_ held.
  void leave_out(int peer, const std::string& why);
  // check_member, then the store's record (admin calls, failed exchanges).
  void check_member_in_store(const char* what);
  [[noreturn]] void throw_left_out(const char* what) const;
  void set_masked_locked(int peer, bool masked, uint64_t calls);  // admin_mu_ held
  void check_slot(int peer, const char* what) const;
  // Every slot in range, not this rank's, and listed once.
  void check_slots(const std::vector<int>& peers, const char* what) const;
  Deadline metadata_deadline() const { return Deadline::after_ms(config_.metadata_timeout_ms); }

  ElasticConfig config_;
  Store& store_;
  uint32_t incarnation_ = 0;
  std::unique_ptr<Endpoint> endpoint_;
  std::unique_ptr<Channels> channels_;
  SlotTable slots_;
  // admin_mu_ serialises connect/disconnect/set_masked, which wait for the
  // store without mu_; mu_ is held by every exchange and by the short steps
  // that change a slot, so a change never lands in the middle of an exchange
  // and staging a peer does not hold up traffic among the others.
  std::mutex admin_mu_;
  mutable std::mutex mu_;
  std::vector<Peer> peers_;
  std::vector<int> left_out_peers_;    // take_left_out's
  int64_t last_exchange_us_ = 0;       // when the last exchange ended (now_us)
  std::atomic<bool> left_out_{false};  // found so in the store (the hint is read live)
  std::vector<std::string> events_;
  std::vector<std::pair<int, std::string>> rejections_;  // of the last exchange
  // exchange(), or with `reject` its rejecting form (see reject()).
  std::vector<uint8_t> run_exchange(const void* const* send, const size_t* send_bytes,
                                    void* const* recv, const size_t* recv_bytes, int bound,
                                    int64_t timeout_ms, const std::string* reject);
};

}  // namespace mooncake
