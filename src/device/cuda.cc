#include "device/cuda.h"

#include <cstring>
#include <thread>

#include "core/clock.h"
#include "core/thread.h"

namespace mooncake {

void cuda_check(cudaError_t err, const char* what, ErrorKind kind) {
  if (err != cudaSuccess) throw_error(kind, -1, "CUDA: ", what, ": ", cudaGetErrorString(err));
}

void* mapped_bytes(size_t bytes, void** dev, const char* what) {
  void* host = nullptr;
  cuda_check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped), what);
  std::memset(host, 0, bytes);
  const cudaError_t err = cudaHostGetDevicePointer(dev, host, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    cuda_check(err, "cudaHostGetDevicePointer");
  }
  return host;
}

int32_t* mapped_words(int64_t n, int32_t** dev, const char* what) {
  void* d = nullptr;
  auto* words =
      static_cast<int32_t*>(mapped_bytes(static_cast<size_t>(n) * sizeof(int32_t), &d, what));
  *dev = static_cast<int32_t*>(d);
  return words;
}

OnDevice::OnDevice(int device) {
  cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = true;
  }
}

OnDevice::~OnDevice() {
  if (changed_) cudaSetDevice(previous_);  // (a call per op saved where it was current)
}

RelaxedCapture::RelaxedCapture() : previous_(cudaStreamCaptureModeRelaxed) {
  cudaThreadExchangeStreamCaptureMode(&previous_);
}

RelaxedCapture::~RelaxedCapture() {
  cudaThreadExchangeStreamCaptureMode(&previous_);
}

void check_capture_intact(cudaStreamCaptureStatus capture, const char* op) {
  MC_CHECK_ARG(capture != cudaStreamCaptureStatusInvalidated, op,
               ": the CUDA graph capture of the current stream was already invalidated before "
               "this call, by an earlier CUDA call made while it captured (a synchronize, an "
               "allocation or a copy with pageable host memory, from this thread or, in the "
               "default global capture mode, any other); the capture ends in error whatever "
               "this op does");
}

void relax_library_threads() {
  thread_start_hook().store(
      [] {
        cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
        cudaThreadExchangeStreamCaptureMode(&mode);
      },
      std::memory_order_release);
}

CudaEvent::CudaEvent(bool blocking) {
  cuda_check(cudaEventCreateWithFlags(
                 &event_, cudaEventDisableTiming | (blocking ? cudaEventBlockingSync : 0)),
             "cudaEventCreate");
}

CudaEvent::~CudaEvent() {
  cudaEventDestroy(event_);
}

void CudaEvent::record(cudaStream_t stream) {
  cuda_check(cudaEventRecord(event_, stream), "cudaEventRecord");
}

void CudaEvent::block(cudaStream_t stream) {
  cuda_check(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

bool CudaEvent::query() {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  cuda_check(err, "cudaEventQuery");
  return true;
}

void CudaEvent::synchronize() {
  cuda_check(cudaEventSynchronize(event_), "cudaEventSynchronize");
}

void CudaEvent::wait(int64_t poll_us) {
  const int64_t poll_until = now_us() + poll_us;
  while (!query()) {
    if (now_us() > poll_until) {
      synchronize();
      return;
    }
    std::this_thread::yield();
  }
}

void LaunchOrder::before(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  cuda_check(cudaStreamGetCaptureInfo(stream, &status, &id), "cudaStreamGetCaptureInfo");
  capture_ = status == cudaStreamCaptureStatusActive ? id : 0;
  Last& last = capture_ == 0 ? eager_ : captured_;
  if (last.any && last.capture == capture_) last.done.block(stream);
}

void LaunchOrder::after(cudaStream_t stream) {
  Last& last = capture_ == 0 ? eager_ : captured_;
  last.done.record(stream);
  last.any = true;
  last.capture = capture_;
}

void LaunchOrder::wait_eager() {
  if (eager_.any) eager_.done.wait();
}

void LaunchOrder::join_eager(cudaStream_t stream) {
  if (eager_.any) eager_.done.block(stream);
}

std::string device_bus_id(int device) {
  char id[32] = {};
  cuda_check(cudaDeviceGetPCIBusId(id, sizeof(id), device), "cudaDeviceGetPCIBusId");
  return id;
}

int device_sm_count(int device) {
  int n = 0;
  cuda_check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  return n;
}

}  // namespace mooncake
