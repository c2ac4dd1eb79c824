#include "device/p2p_buffers.h"

#include <algorithm>
#include <bit>

#include "core/log.h"
#include "device/cuda.h"

namespace mooncake {

P2PBuffers::~P2PBuffers() {
  // Lent ones may still be read by a peer, and mappings of peers' buffers by
  // a copy still queued: both are left to the process's end.
  OnDevice on(device_);
  for (const Buffer& b : buffers_)
    if (b.free) cudaFree(b.ptr);
}

P2PBuffers::Lent P2PBuffers::lend(size_t bytes) {
  const size_t size = std::bit_ceil(std::max(bytes, kMinBytes));
  std::lock_guard<std::mutex> lock(mu_);
  if (lent_bytes_ + size > kWarnLentBytes && !warned_) {
    warned_ = true;
    MC_LOG(kWarn, "device-to-device sends not yet received hold ", lent_bytes_ + size,
           " bytes of GPU memory (their receivers have not posted the recvs)");
  }
  size_t at = buffers_.size();
  for (size_t i = 0; i < buffers_.size(); ++i)
    if (buffers_[i].free && buffers_[i].bytes == size) {
      at = i;
      break;
    }
  if (at == buffers_.size()) {
    OnDevice on(device_);
    Buffer b;
    b.bytes = size;
    cuda_check(cudaMalloc(&b.ptr, size), "cudaMalloc of a point-to-point buffer");
    const cudaError_t err = cudaIpcGetMemHandle(&b.handle, b.ptr);
    if (err != cudaSuccess) {
      cudaFree(b.ptr);
      cuda_check(err, "cudaIpcGetMemHandle of a point-to-point buffer");
    }
    buffers_.push_back(b);
  }
  Buffer& b = buffers_[at];
  b.free = false;
  lent_bytes_ += b.bytes;
  const uint64_t id = next_id_++;
  lent_[id] = at;
  return Lent{b.ptr, id, b.handle};
}

void P2PBuffers::give_back(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = lent_.find(id);
    if (it == lent_.end()) return;
    Buffer& b = buffers_[it->second];
    b.free = true;
    lent_bytes_ -= b.bytes;
    lent_.erase(it);
  }
}

void P2PBuffers::forget(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = lent_.find(id);
    if (it == lent_.end()) return;
    // Its buffer stays taken (never lent nor freed again), but no longer
    // counts against the cap.
    lent_bytes_ -= buffers_[it->second].bytes;
    lent_.erase(it);
  }
}

void* P2PBuffers::open(const cudaIpcMemHandle_t& handle) {
  const std::string key(reinterpret_cast<const char*>(&handle), sizeof(handle));
  std::lock_guard<std::mutex> lock(mu_);
  if (const auto it = opened_.find(key); it != opened_.end()) return it->second;
  OnDevice on(device_);
  void* ptr = nullptr;
  cuda_check(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess),
             "cudaIpcOpenMemHandle of a peer's point-to-point buffer");
  opened_.emplace(key, ptr);
  return ptr;
}

size_t P2PBuffers::lent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lent_.size();
}

}  // namespace mooncake
