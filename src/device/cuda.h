// The CUDA runtime as the device library uses it: one error helper for every
// CUDA call (here and in the torch adapter), the current device set for a
// scope, events, and the device queries the launches size themselves by.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace mooncake {

// Throws an Error of `kind` naming `what` and the CUDA error unless `err` is cudaSuccess.
void cuda_check(cudaError_t err, const char* what, ErrorKind kind = ErrorKind::kSystem);

// `bytes` zeroed bytes of host memory the device maps (cudaFreeHost frees
// them): the host's pointer, and the device's in `dev`. Throws as cuda_check,
// naming `what` when the allocation fails.
void* mapped_bytes(size_t bytes, void** dev, const char* what);
// The same as `n` int32 words.
int32_t* mapped_words(int64_t n, int32_t** dev, const char* what);

// `n` zeroed T's of device memory on the current device (cudaFree frees
// them); throws as cuda_check, naming `what`, when CUDA cannot allocate.
template <typename T>
T* device_zeros(size_t n, const char* what) {
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, n * sizeof(T)), what);
  const cudaError_t err = cudaMemset(p, 0, n * sizeof(T));
  if (err != cudaSuccess) {
    cudaFree(p);
    cuda_check(err, what);
  }
  return static_cast<T*>(p);
}

// Makes `device` current for the scope and puts the caller's back afterwards.
class OnDevice {
 public:
  explicit OnDevice(int device);
  ~OnDevice();
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// For the scope, this thread's CUDA calls may run while another thread
// captures a CUDA graph. For the library's own threads (the op queue, the view
// listener, completions): torch captures in "global" mode by default, where a
// sync, copy or allocation from any other thread invalidates the caller's
// capture (NCCL's threads do the same).
class RelaxedCapture {
 public:
  RelaxedCapture();
  ~RelaxedCapture();
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode previous_;
};

// `op` called on a stream whose capture status is `capture`: where the
// capture was invalidated before the call (by a sync, an allocation or a
// pageable copy made during it, from this thread or, in global capture mode,
// another one), throws an argument error that says so, as whatever the op did
// the capture ends in error.
void check_capture_intact(cudaStreamCaptureStatus capture, const char* op);

// From now on, every library thread that starts (core/thread.h) runs in
// relaxed capture mode for its whole life: none of them captures, and any
// CUDA call they make (an event query, a copy, a free) must not break a
// capture of the caller's. Threads already running keep their mode (those that
// make CUDA calls take RelaxedCapture around them).
void relax_library_threads();

// A CUDA event of the device current when it is made (no timing: ordering
// does not need it).
class CudaEvent {
 public:
  // `blocking`: a host wait for it sleeps instead of spinning.
  explicit CudaEvent(bool blocking);
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(cudaStream_t stream);
  // Work queued on `stream` from now on waits for the event.
  void block(cudaStream_t stream);
  bool query();
  void synchronize();
  // Waits on the host: polls, yielding, for up to `poll_us` first (the work
  // waited for is usually a short copy), then blocks (sleeping, for a blocking
  // event: the wake-up from that sleep took 100-170 us on an H100 under MPS).
  void wait(int64_t poll_us = 50);

 private:
  cudaEvent_t event_ = nullptr;
};

// Runs one object's launches one after another, whatever stream each caller
// queues them on, as they share its state (op numbers, rings, barriers): an
// eager launch on another stream than the last eager one's waits for it, and
// a captured launch for the last one of its capture on another stream (a
// dependency of the graph). Across a capture's edge none can be expressed: the
// caller orders replays (as for NCCL). Every launch waits for the last one,
// on its own stream too (a no-op there): a stream destroyed and made again may
// get its handle back, and cudaStreamGetId, which would tell them apart, may
// not be called under capture (it breaks the capture). Costs an event record,
// an event wait and a capture query per launch. Made with the device current.
class LaunchOrder {
 public:
  LaunchOrder() : eager_(false), captured_(false) {}
  // Before a launch on `stream`.
  void before(cudaStream_t stream);
  // After it (not called when the launch threw: the last one stays the last).
  void after(cudaStream_t stream);
  // Waits on the host until the last eager launch has run.
  void wait_eager();
  // Work queued on `stream` from now on waits for the last eager launch.
  void join_eager(cudaStream_t stream);

 private:
  struct Last {
    explicit Last(bool blocking) : done(blocking) {}
    CudaEvent done;  // recorded after the launch
    bool any = false;
    unsigned long long capture = 0;  // a captured one's capture
  };
  Last eager_, captured_;
  unsigned long long capture_ = 0;  // before()'s query, for after() (0: eager)
};

// `n` T's of device memory on the current device, zeroed, with host copies in
// and out (blocking): the buffers a C++ caller hands the collectives and the
// EP buffer.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n)
      : p_(device_zeros<T>(std::max<size_t>(n, 1), "cudaMalloc")), n_(n) {}
  explicit DeviceArray(const std::vector<T>& v) : DeviceArray(v.size()) { put(v); }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  void put(const std::vector<T>& v) {
    MC_CHECK_ARG(v.size() <= n_, "DeviceArray::put: ", v.size(), " values into ", n_);
    cuda_check(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
               "copy to the device");
  }
  std::vector<T> take() const {
    std::vector<T> v(n_);
    cuda_check(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost),
               "copy from the device");
    return v;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// The PCI bus id of `device` ("0000:1b:00.0"): processes with the same one
// share a GPU (and so its multiprocessors).
std::string device_bus_id(int device);

// The number of multiprocessors of `device`.
int device_sm_count(int device);

}  // namespace mooncake
