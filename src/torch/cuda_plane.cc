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
      bytes_(bytes) {
  store_.set(prefix_ + "cuda/host/" + std::to_string(rank_), host_identity());
}

std::string CudaPlane::key(int slot, uint32_t incarnation) const {
  return prefix_ + "cuda/seg/" + std::to_string(slot) + "/" + std::to_string(incarnation);
}

uint8_t* CudaPlane::mine(const View& view) {
  if (!segment_) {
    segment_ = std::make_unique<DeviceSegment>(bytes_, device_);
    store_.set(key(rank_, view.incarnation[static_cast<size_t>(rank_)]), segment_->handle());
  }
  return segment_->data();
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

std::vector<const uint8_t*> CudaPlane::segments(const std::vector<int>& members, const View& view,
                                                int64_t timeout_ms) {
  std::vector<const uint8_t*> out;
  out.reserve(members.size());
  for (int p : members) {
    if (p == rank_) {
      out.push_back(mine(view));
      continue;
    }
    const uint32_t incarnation = view.incarnation[static_cast<size_t>(p)];
    Peer& peer = peers_[p];
    if (!peer.mapping || peer.incarnation != incarnation) {  // a process not mapped yet
      peer.mapping =
          std::make_unique<PeerMapping>(store_.get(key(p, incarnation), timeout_ms), device_);
      peer.incarnation = incarnation;
    }
    out.push_back(peer.mapping->data());
  }
  return out;
}

}  // namespace mooncake

#endif  // MOONCAKE_WITH_CUDA
