// Who maps whom. A process with a device segment publishes a card: the
// segment's IPC handle, the host it runs on and its GPU. A peer maps the
// segment only when it runs on the same host, and counts the processes that
// share its GPU from the cards (their kernels split the GPU's
// multiprocessors: every block of a launch must be resident at once).
//
// Same host means the same boot id and the same network namespace, as the
// host transports judge it (src/transport): processes in another namespace
// stand in for other machines in our tests, and must be other hosts for
// every transport alike. Same GPU means the same machine (boot id) and PCI
// bus id, whatever the namespace: what shares multiprocessors is hardware.
//
// Ranks on different GPUs of one host map each other's segments through peer
// access (ipc.h), which not every pair of GPUs has: each rank of the
// collectives records which of the host's GPUs its own reaches (GpuRecord),
// and the group takes the device plane only where every pair reaches the
// other both ways (judge_reach), else stages through host memory.
//
// The collectives' segments are published in the store under their slot and
// incarnation (PeerDirectory): a replacement process publishes its own, and
// the others map it when the view names it. The EP buffers exchange the same
// cards through their members (a group's all-gather, an elastic buffer's
// slot records).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/host.h"
#include "device/ipc.h"
#include "store/store.h"
#include "transport/life.h"

namespace mooncake {

// This host's identity as the transports judge it: boot id and network namespace.
std::string host_identity();

struct PeerCard {
  // An encoded card's size (fixed, so that cards travel in all-gathers).
  static constexpr size_t kBytes = 256;

  std::string handle;  // kIpcHandleBytes: what PeerMapping opens
  std::string boot;    // the publisher's boot_id()
  std::string netns;   // and net_namespace()
  std::string bus_id;  // its GPU's PCI bus id
  // Its process's life page (transport/life.h), for a peer whose kernels read
  // it (LostWords::watch_life); invalid where that process has none. Named by
  // pid, so only a peer in the same pid namespace can map it.
  std::string pidns;  // the publisher's pid_namespace()
  LifeRef life;

  // The card of this process's `segment`.
  static PeerCard of(const DeviceSegment& segment);
  std::string encode() const;
  // nullopt for anything but an encoded card (an absent peer's zeros included).
  static std::optional<PeerCard> decode(std::string_view bytes);

  bool on_this_host() const { return boot == boot_id() && netns == net_namespace(); }
  // Its life page, where this process can map it; else an invalid LifeRef.
  LifeRef life_here() const;
  bool same_gpu(const PeerCard& other) const {
    return boot == other.boot && bus_id == other.bus_id;
  }
};

// The processes on `mine`'s GPU among `cards` (nullopt: absent), at least 1
// (`mine` itself, whether or not it is among them).
int gpu_sharers(const PeerCard& mine, const std::vector<std::optional<PeerCard>>& cards);

// A process's GPU as its peers judge whether they can map its memory.
struct GpuRecord {
  std::string host;    // host_identity()
  std::string bus_id;  // its GPU's PCI bus id
  // The bus ids of the host's other GPUs that its GPU has peer access to
  // (cudaDeviceCanAccessPeer). A GPU that CUDA_VISIBLE_DEVICES hides from the
  // process cannot be asked, so it is not among them.
  std::vector<std::string> reaches;

  // This process's, on `device`.
  static GpuRecord of(int device);
  std::string encode() const;
  // nullopt for anything but an encoded record.
  static std::optional<GpuRecord> decode(std::string_view bytes);
};

// Whether the ranks of `records` (by rank; nullopt: unknown) can map each
// other's segments, from the records alone: every rank that judges from the
// same records gets the same answer.
struct Reach {
  bool same_host = false;  // every rank on `me`'s host
  // Where two of those ranks are on GPUs that do not reach each other both
  // ways, which ones, in words (the plane is then off); else empty.
  std::string no_peer_access;
  int gpu_sharers = 1;  // ranks on `me`'s GPU, `me` included

  bool mappable() const { return same_host && no_peer_access.empty(); }
};
Reach judge_reach(const std::vector<std::optional<GpuRecord>>& records, int me);

// Cards in the store, by slot and incarnation, and the peers' segments mapped
// from them (once per incarnation).
class PeerDirectory {
 public:
  PeerDirectory(Store& store, std::string prefix, int device);

  // Records this process's host and GPU (GpuRecord) for `slot`, before it
  // has a segment, so that everyone can tell whether the group's segments
  // can be mapped among its ranks.
  void publish_host(int slot);
  // judge_reach over slots [0, n) (waiting up to timeout_ms for each to
  // record itself), `slot` being this process's.
  Reach reach(int n, int slot, int64_t timeout_ms);
  void publish(int slot, uint32_t incarnation, const PeerCard& card);
  // `slot`'s segment as published under `incarnation` (waiting up to
  // timeout_ms for it), mapped here. Throws kPeerFailed when it cannot be
  // mapped (another host, or its process is gone).
  const uint8_t* map(int slot, uint32_t incarnation, int64_t timeout_ms);
  // The life page (PeerCard::life_here) of the process map() last mapped at
  // `slot`; invalid where none is.
  LifeRef life(int slot) const;

 private:
  std::string key(int slot, uint32_t incarnation) const;

  Store& store_;
  const std::string prefix_;
  const int device_;
  struct Peer {
    uint32_t incarnation = 0;
    std::unique_ptr<PeerMapping> mapping;
    LifeRef life;
  };
  std::map<int, Peer> peers_;
};

}  // namespace mooncake
