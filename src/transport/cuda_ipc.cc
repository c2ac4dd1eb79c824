#include "transport/cuda_ipc.h"

#include <cuda_runtime.h>

#include <cstring>

#include "core/error.h"
#include "core/log.h"

namespace mooncake {

namespace {

void check(cudaError_t err, ErrorKind kind, const char* what) {
  if (err != cudaSuccess) throw_error(kind, -1, "cuda_ipc: ", what, ": ", cudaGetErrorString(err));
}

// Runs on `device` and puts the caller's device back afterwards.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    check(cudaGetDevice(&previous_), ErrorKind::kSystem, "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), ErrorKind::kSystem, "cudaSetDevice");
  }
  ~OnDevice() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace

DeviceSegment::DeviceSegment(size_t bytes, int device) : size_(bytes), device_(device) {
  OnDevice on(device);
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), ErrorKind::kSystem, "cudaMalloc of the workspace");
  data_ = static_cast<uint8_t*>(p);
  // Zero: no signal of a call (sequence numbers start at 1) is there yet.
  const cudaError_t err = cudaMemset(data_, 0, bytes);
  if (err != cudaSuccess) {
    cudaFree(data_);
    check(err, ErrorKind::kSystem, "cudaMemset of the workspace");
  }
  check(cudaDeviceSynchronize(), ErrorKind::kSystem, "clearing the workspace");
}

DeviceSegment::~DeviceSegment() {
  OnDevice on(device_);
  // Peers may still map it: the driver keeps the memory until they let go.
  if (cudaFree(data_) != cudaSuccess) MC_LOG(kWarn, "cuda_ipc: cudaFree of the workspace failed");
}

std::string DeviceSegment::handle() const {
  OnDevice on(device_);
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, data_), ErrorKind::kSystem, "cudaIpcGetMemHandle");
  static_assert(sizeof(h) == kIpcHandleBytes);
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

PeerMapping::PeerMapping(const std::string& handle, int device) : device_(device) {
  MC_CHECK_ARG(handle.size() == kIpcHandleBytes, "cuda_ipc: a handle is ", kIpcHandleBytes,
               " bytes, got ", handle.size());
  OnDevice on(device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // the failure is answered here, not by the next call
    throw_error(ErrorKind::kPeerFailed, -1,
                "cuda_ipc: cannot map the peer's workspace: ", cudaGetErrorString(err));
  }
  data_ = static_cast<uint8_t*>(p);
}

PeerMapping::~PeerMapping() {
  OnDevice on(device_);
  if (cudaIpcCloseMemHandle(data_) != cudaSuccess)
    MC_LOG(kWarn, "cuda_ipc: cudaIpcCloseMemHandle failed");
}

std::string device_bus_id(int device) {
  char id[32] = {};
  check(cudaDeviceGetPCIBusId(id, sizeof(id), device), ErrorKind::kSystem, "cudaDeviceGetPCIBusId");
  return id;
}

int device_sm_count(int device) {
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), ErrorKind::kSystem,
        "cudaDeviceGetAttribute");
  return n;
}

}  // namespace mooncake
