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
// Each rank publishes in the store which host it runs on (when the group is
// made) and its segment's handle (when its first op on the plane allocates
// the segment, so a group that never uses the plane costs no device memory),
// under its slot and incarnation: a replacement process publishes its own,
// and the others map it when the view names it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "membership/view.h"
#include "store/store.h"
#include "transport/cuda_ipc.h"

namespace mooncake {

class CudaPlane {
 public:
  // A plane of `bytes`-byte segments on `device`; publishes this host's identity.
  CudaPlane(Store& store, std::string prefix, int rank, int world_size, int device, size_t bytes);

  size_t capacity() const { return bytes_; }
  // This rank's segment (allocated and published on the first call, under
  // this process's incarnation in `view`).
  uint8_t* mine(const View& view);
  // Whether ranks [0, world size) all run on this host (asked of the store
  // once; every rank gets the same answer).
  bool same_host(int64_t timeout_ms);
  // The segments of `members`, in order (this rank's own among them); maps
  // a member's when its process is new, waiting up to timeout_ms for it to
  // publish.
  std::vector<const uint8_t*> segments(const std::vector<int>& members, const View& view,
                                       int64_t timeout_ms);

 private:
  std::string key(int slot, uint32_t incarnation) const;

  Store& store_;
  const std::string prefix_;
  const int rank_;
  const int world_size_;
  const int device_;
  const size_t bytes_;
  std::unique_ptr<DeviceSegment> segment_;
  int same_host_ = -1;  // -1: not asked yet
  struct Peer {
    uint32_t incarnation = 0;
    std::unique_ptr<PeerMapping> mapping;
  };
  std::map<int, Peer> peers_;
};

// This host's identity as the transports judge it: boot id and network namespace.
std::string host_identity();

}  // namespace mooncake
