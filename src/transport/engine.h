// The transfer engine. `TransferEngine` holds the transport policy (forced
// tcp, host ip, device filter) and can be shared by several process groups;
// each group owns an `Endpoint`: its local segment and one PeerLink per peer,
// chosen per peer (shm when the peer is on this host, tcp otherwise).
// Peers find each other through the Store.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "store/store.h"
#include "transport/link.h"
#include "transport/segment.h"
#include "transport/tcp.h"

namespace mooncake {

struct EngineOptions {
  bool force_tcp = false;                  // MOONCAKE_TRANSPORT=tcp
  std::string host_ip;                     // MOONCAKE_HOST_IP or pg.set_host_ip
  std::vector<std::string> device_filter;  // RDMA devices to use (none exist yet)

  static EngineOptions from_env();
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

class Endpoint {
 public:
  // Creates this rank's segment, publishes its address under `prefix`, connects
  // to every rank in [0, size) and waits until all of them have done the same.
  Endpoint(const TransferEngine& engine, Store& store, const std::string& prefix, int rank,
           int size, size_t segment_bytes, const Deadline& deadline);
  ~Endpoint();

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint8_t* base() const { return segment_.base(); }
  Doorbell* bell(int i) const { return segment_.bell(i); }
  PeerLink& link(int peer) { return *links_[peer]; }
  bool alive(int peer) { return links_[peer]->alive(); }
  const char* transport_of(int peer) const { return links_[peer]->transport(); }

 private:
  int rank_;
  int size_;
  Segment segment_;
  std::unique_ptr<TcpReceiver> receiver_;
  std::vector<std::unique_ptr<PeerLink>> links_;
};

}  // namespace mooncake
