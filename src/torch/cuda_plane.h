// The CUDA backend's device plane: when every rank of the group runs on this
// host, each rank's device segment (transport/cuda_ipc.h) is mapped by the
// others, and all_reduce, broadcast, all_gather_into_tensor and
// reduce_scatter_tensor move their bytes GPU to GPU: an op copies its input
// into its own segment, the members meet in a round of headers (so every
// input is in place), each reads the others' segments with a kernel or a
// copy, waits for it, and the op's commit round says every member is done
// reading (see Communicator::run_external). The segment keeps the input, so
// an op that a failure interrupts re-runs among the survivors from it.
//
// Each rank publishes in the store which host it runs on and its segment's
// handle; a replacement process for a slot publishes new ones, which the
// others map when the view changes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/store.h"
#include "transport/cuda_ipc.h"

namespace mooncake {

class CudaPlane {
 public:
  // Allocates this rank's segment of `bytes` on `device` and publishes it.
  CudaPlane(Store& store, std::string prefix, int rank, int world_size, int device, size_t bytes);

  size_t capacity() const { return segment_.size(); }
  uint8_t* mine() const { return segment_.data(); }
  // Whether ranks [0, world size) all run on this host (asked of the store
  // once; every rank gets the same answer).
  bool same_host(int64_t timeout_ms);
  // The segments of `members`, in order (this rank's own among them),
  // re-reading the handles when `epoch` changed.
  std::vector<const uint8_t*> segments(const std::vector<int>& members, uint64_t epoch,
                                       int64_t timeout_ms);

 private:
  Store& store_;
  const std::string prefix_;
  const int rank_;
  const int world_size_;
  const int device_;
  DeviceSegment segment_;
  int same_host_ = -1;  // -1: not asked yet
  uint64_t epoch_ = ~0ull;
  struct Peer {
    std::string handle;
    std::unique_ptr<PeerMapping> mapping;
  };
  std::map<int, Peer> peers_;
};

// This host's identity as the transports judge it: boot id and network namespace.
std::string host_identity();

}  // namespace mooncake
