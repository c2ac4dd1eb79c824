// Any-host transport over UCX (its verbs, rdmacm, tcp and shared-memory
// transports, whichever the machine has): RDMA where the hardware exists,
// tcp here, with the same code either way.
//
// Each rank runs one UCX worker per group (UcxWorker) with a progress thread
// that sleeps on the worker's event fd. Its address goes into the store with
// the rest of the PeerAddress; a UcxLink is this rank's sending side to one
// peer, an endpoint to that peer's worker.
//
// Everything is an active message with a fixed header (UcxHeader): a write
// carries its payload (UCX picks eager or rendezvous; a rendezvous payload is
// fetched straight into the segment), a signal stores a flag and rings a
// doorbell. Small writes wait in the link and go with the signal that
// follows them, as one message: a collective's header, payload and flag
// cost one message instead of three. UCX does not promise that active messages arrive in order (a
// rendezvous payload lands after later messages; multi-rail and adaptive
// routing reorder), so ordering is ours: a link numbers its writes, a signal
// names how many writes came before it, and the receiver holds a signal back
// until those writes have landed.
//
// Every message carries the group's secret (compared in constant time) and
// the sender's slot, incarnation and link number; anything else is dropped
// and counted, as the tcp receiver does. A message from an older incarnation
// or an older link of a slot than one already heard from is dropped: a late
// write from a replaced process never lands.
//
// A peer is gone when UCX reports an error on the endpoint to it (the
// heartbeats that every link sends every 20 ms find a closed connection).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/link.h"
#include "transport/secret.h"
#include "transport/segment.h"

namespace mooncake {

// Whether this build has the ucx transport (libucx-dev was found).
bool ucx_built();

// The RDMA devices of this machine as UCX names them ("mlx5_0:1", one per
// port), from /sys/class/infiniband; empty where there are none.
std::vector<std::string> rdma_devices();

// The header of every active message of the ucx transport.
// A message's payload (of any type) lands at `offset` first; a signal then
// stores `value` into the flag at `flag` and rings `bell`.
struct UcxHeader {
  uint32_t type;    // a FrameType (tcp_wire.h): write, signal, signal_max, heartbeat, bye
  uint32_t bell;    // signals: the doorbell to ring
  uint64_t offset;  // where the payload goes in the receiver's segment
  uint64_t flag;    // signals: the flag's offset
  uint64_t value;   // signals: the value
  uint64_t link;    // the sending link's number (grows per process)
  uint64_t seq;     // write: its number on the link (from 1); signal: writes sent before it
  int32_t rank;     // the sender's slot
  uint32_t inc;     // and incarnation
  char secret[kSecretBytes];
};
static_assert(sizeof(UcxHeader) == 56 + kSecretBytes);

class UcxWorker {
 public:
  // A worker that places peers' writes into `segment` (room for `capacity`
  // slots), for peers that know `secret`. `devices`: UCX device names to use
  // (empty: UCX's default, every device). `alarm` is bumped when an endpoint
  // fails. Throws kInvalidArgument when this build has no ucx transport, and
  // kSystem when UCX cannot start.
  UcxWorker(Segment& segment, int capacity, std::string secret,
            const std::vector<std::string>& devices, std::atomic<uint64_t>* alarm);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // This worker's address, in hex, for the PeerAddress.
  const std::string& address() const;
  // Messages dropped for breaking the protocol.
  uint64_t rejected() const;
  // Connects to the worker of the peer at `addr` (which has a ucx address) as
  // slot `my_rank`, incarnation `my_inc`.
  std::unique_ptr<PeerLink> connect(const PeerAddress& addr, int my_rank, uint32_t my_inc);

  struct Core;

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace mooncake
