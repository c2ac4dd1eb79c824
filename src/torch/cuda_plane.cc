#if MOONCAKE_WITH_CUDA

#include "torch/cuda_plane.h"

#include <unistd.h>

#include <fstream>

#include "core/error.h"

namespace mooncake {

std::string host_identity() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {};
  ssize_t n = readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  return boot + "/" + std::string(ns, n > 0 ? static_cast<size_t>(n) : 0);
}

CudaPlane::CudaPlane(Store& store, std::string prefix, int rank, int world_size, int device,
                     size_t bytes)
    : store_(store),
      prefix_(std::move(prefix)),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      segment_(bytes, device) {
  store_.set(prefix_ + "cuda/host/" + std::to_string(rank_), host_identity());
  store_.set(prefix_ + "cuda/seg/" + std::to_string(rank_), segment_.handle());
}

bool CudaPlane::same_host(int64_t timeout_ms) {
  if (same_host_ < 0) {
    const std::string mine = host_identity();
    bool same = true;
    for (int r = 0; r < world_size_ && same; ++r)
      same = store_.get(prefix_ + "cuda/host/" + std::to_string(r), timeout_ms) == mine;
    same_host_ = same ? 1 : 0;
  }
  return same_host_ == 1;
}

std::vector<const uint8_t*> CudaPlane::segments(const std::vector<int>& members, uint64_t epoch,
                                                int64_t timeout_ms) {
  if (epoch != epoch_) {
    for (int p : members) {
      if (p == rank_) continue;
      std::string handle = store_.get(prefix_ + "cuda/seg/" + std::to_string(p), timeout_ms);
      Peer& peer = peers_[p];
      if (peer.handle != handle) {  // a new process in that slot: map its segment
        peer.mapping = std::make_unique<PeerMapping>(handle, device_);
        peer.handle = std::move(handle);
      }
    }
    epoch_ = epoch;
  }
  std::vector<const uint8_t*> out;
  out.reserve(members.size());
  for (int p : members) {
    if (p == rank_) {
      out.push_back(segment_.data());
      continue;
    }
    auto it = peers_.find(p);
    MC_ASSERT(it != peers_.end() && it->second.mapping, "segment of member ", p, " not mapped");
    out.push_back(it->second.mapping->data());
  }
  return out;
}

}  // namespace mooncake

#endif  // MOONCAKE_WITH_CUDA
