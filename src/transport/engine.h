// The transfer engine. `TransferEngine` holds the transport policy (forced
// tcp, host ip, device filter) and can be shared by several process groups;
// each group owns an `Endpoint`: its local segment and one PeerLink per peer,
// chosen per peer (shm when the peer is on this host; otherwise ucx where
// both ends run a UCX worker, else tcp).
// Peers find each other through the Store.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "store/store.h"
#include "transport/life.h"
#include "transport/link.h"
#include "transport/segment.h"
#include "transport/tcp.h"
#include "transport/ucx.h"

namespace mooncake {

struct EngineOptions {
  bool force_tcp = false;                  // MOONCAKE_TRANSPORT=tcp
  bool force_ucx = false;                  // MOONCAKE_TRANSPORT=ucx
  std::string host_ip;                     // MOONCAKE_HOST_IP or pg.set_host_ip
  std::vector<std::string> device_filter;  // devices the ucx transport may use (UCX names)

  static EngineOptions from_env();
  // Whether a group runs a UCX worker: when forced, or in auto mode where
  // this build has ucx and the machine has an RDMA device. Throws
  // kInvalidArgument when forced in a build without ucx.
  bool wants_ucx() const;
};

class TransferEngine {
 public:
  explicit TransferEngine(EngineOptions options) : options_(std::move(options)) {}
  const EngineOptions& options() const { return options_; }
  EngineOptions& mutable_options() { return options_; }
  // Transports this build can use on this machine, e.g. {"shm", "tcp"}.
  static std::vector<std::string> available_transports();

 private:
  EngineOptions options_;
};

// Where the process holding slot `rank` as incarnation `inc` publishes its
// PeerAddress in the store.
std::string address_key(const std::string& prefix, int rank, uint32_t inc);

// One group's end of the transport in this process: the local segment, the
// tcp receiver, one PeerLink per connected slot, and a heartbeat thread that
// lets peers tell a stopped process from a slow one. Slots are connected and
// disconnected as the group's membership changes; links are shared, so a
// thread that holds one keeps it valid while it is replaced.
class Endpoint {
 public:
  // Creates this rank's segment with room for `capacity` slots and publishes
  // its address under prefix + "addr/<rank>/<incarnation>".
  Endpoint(const TransferEngine& engine, Store& store, std::string prefix, int rank,
           uint32_t incarnation, int capacity, size_t segment_bytes);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // The initial rendezvous: connects to slots [0, size) (incarnation 0) and
  // waits until every one of them has done the same.
  void connect_all(int size, const Deadline& deadline);
  // Connects to the process holding slot `peer` as incarnation `inc`,
  // replacing any earlier link to that slot.
  void connect(int peer, uint32_t inc, const Deadline& deadline);
  // Drops the link to `peer` (its memory is unmapped once no thread uses it).
  // With `farewell`, the peer is told it is on purpose, so that it does not
  // take this process for dead (a live pair that reconnects later).
  void disconnect(int peer, bool farewell = false);

  int rank() const { return rank_; }
  uint32_t incarnation() const { return incarnation_; }
  int capacity() const { return capacity_; }
  uint8_t* base() const { return segment_.base(); }
  size_t segment_bytes() const { return segment_.size(); }
  Doorbell* bell(int i) const { return segment_.bell(i); }
  // The link to `peer`, or null when that slot is not connected.
  std::shared_ptr<PeerLink> link(int peer) const;
  // False when `peer` is gone or not connected.
  bool alive(int peer) const;
  uint64_t heartbeat(int peer) const;
  // How long `peer`'s heartbeat has stood still, in ms (sampled every 20 ms
  // by the heartbeat thread; 0 when not connected, when the heartbeat moved
  // since the last sample, or while this process's own heartbeat thread lags).
  int64_t silent_ms(int peer) const;
  // "shm", "tcp", "ucx", "self", or "none" when not connected.
  const char* transport_of(int peer) const;
  // Connections the tcp receiver dropped, and messages the ucx worker
  // dropped, for breaking the protocol.
  uint64_t rejected_connections() const {
    return receiver_->rejected() + (ucx_ ? ucx_->rejected() : 0);
  }
  int tcp_port() const { return receiver_->port(); }
  // Hint word `slot` (in [0, kNumHints)) of the local segment header (see
  // SegmentHeader::hints; the layer above names the slots).
  uint64_t hint(int slot) const;
  // Raises hint word `slot` of `peer`'s segment to `value` (never lowers
  // it: a stale writer cannot undo a newer hint) and rings its doorbells
  // (best effort: a peer that is gone is skipped).
  void post_hint(int peer, int slot, uint64_t value);
  // Bumped (and every doorbell rung) as soon as a connected peer is seen gone:
  // a wait that watches it looks at its peers at once, not at its next poll.
  uint64_t alarms() const { return alarms_.load(std::memory_order_acquire); }
  // Rings every doorbell of the local segment: blocked waits look again.
  void wake_all();

  // For what must hear of a lost peer at once but cannot watch processes
  // itself (kernels spinning on a peer's signal): `fn(peer, why)` is called
  // from the heartbeat thread as soon as a connected peer is seen gone
  // (kGone, once; peers already gone are told on the first round), when its
  // heartbeat has stood still for `hang_ms` (> 0; kSilent), and when a peer
  // told silent beats again (kBack). `fn` must not block; returning false
  // drops it (its target is gone). unwatch_peers(id): after it returns, `fn`
  // is never called again.
  enum class PeerLoss { kBack = 0, kGone = 1, kSilent = 2 };
  using LossListener = std::function<bool(int peer, PeerLoss why)>;
  uint64_t watch_peers(LossListener fn, int64_t hang_ms);
  void unwatch_peers(uint64_t id);

 private:
  void heartbeat_loop();
  struct Watcher {
    uint64_t id;
    LossListener fn;
    int64_t hang_us;
    std::vector<uint8_t> told;  // per slot: what it was told last (tell_watchers)
    bool fresh = true;          // not told of the peers already gone yet
  };
  // One heartbeat round's news for the watchers: `gone` newly, `dead` all the
  // links seen gone; `still_us[p]`: how long p's heartbeat has stood still.
  void tell_watchers(const std::vector<int>& gone, const std::vector<int>& dead,
                     const std::vector<int64_t>& still_us);

  const EngineOptions options_;
  Store& store_;
  const std::string prefix_;
  const int rank_;
  const uint32_t incarnation_;
  const int capacity_;
  Segment segment_;
  std::string secret_;  // the group's, from the store: proves tcp connections
  std::unique_ptr<TcpReceiver> receiver_;
  std::unique_ptr<UcxWorker> ucx_;  // when the group uses the ucx transport
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<PeerLink>> links_;
  std::vector<uint8_t> on_host_;  // per slot: its process runs on this host (for the spin budget)
  struct Pulse {
    std::atomic<uint64_t> last{0};
    std::atomic<int64_t> changed_us{0};
  };
  std::unique_ptr<Pulse[]> pulse_;      // per slot, written by the heartbeat thread
  std::atomic<int64_t> last_round_us_;  // when the heartbeat thread last went round
  std::atomic<uint64_t> alarms_{0};
  int stop_fd_ = -1;                    // eventfd: stops the heartbeat thread (while it polls)
  std::atomic<uint32_t> stop_word_{0};  // and while it waits on life words
  LifeHold life_;                       // this process's life word, held by the heartbeat thread
  std::mutex watch_mu_;                 // held while watchers are called
  std::vector<Watcher> watchers_;
  uint64_t next_watch_ = 1;
  std::thread heartbeat_;
};

}  // namespace mooncake
