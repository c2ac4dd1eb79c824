#include "device/ipc.h"

#include <cstring>

#include "core/log.h"
#include "device/cuda.h"

namespace mooncake {

DeviceSegment::DeviceSegment(size_t bytes, int device) : size_(bytes), device_(device) {
  OnDevice on(device);
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, bytes), "cudaMalloc of a device segment");
  data_ = static_cast<uint8_t*>(p);
  // Zero: no signal of a call (sequence numbers start at 1) is there yet.
  const cudaError_t err = cudaMemset(data_, 0, bytes);
  if (err != cudaSuccess) {
    cudaFree(data_);
    cuda_check(err, "cudaMemset of a device segment");
  }
  cuda_check(cudaDeviceSynchronize(), "clearing a device segment");
}

DeviceSegment::~DeviceSegment() {
  OnDevice on(device_);
  // Peers may still map it: the driver keeps the memory until they let go.
  if (cudaFree(data_) != cudaSuccess) MC_LOG(kWarn, "ipc: cudaFree of the workspace failed");
}

std::string DeviceSegment::handle() const {
  OnDevice on(device_);
  cudaIpcMemHandle_t h;
  cuda_check(cudaIpcGetMemHandle(&h, data_), "cudaIpcGetMemHandle");
  static_assert(sizeof(h) == kIpcHandleBytes);
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

PeerMapping::PeerMapping(const std::string& handle, int device) : device_(device) {
  MC_CHECK_ARG(handle.size() == kIpcHandleBytes, "ipc: a handle is ", kIpcHandleBytes,
               " bytes, got ", handle.size());
  OnDevice on(device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // the failure is answered here, not by the next call
    cuda_check(err, "ipc: mapping a peer's segment", ErrorKind::kPeerFailed);
  }
  data_ = static_cast<uint8_t*>(p);
}

PeerMapping::~PeerMapping() {
  OnDevice on(device_);
  if (cudaIpcCloseMemHandle(data_) != cudaSuccess)
    MC_LOG(kWarn, "ipc: cudaIpcCloseMemHandle failed");
}

}  // namespace mooncake
