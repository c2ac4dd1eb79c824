// Device memory shared between processes of one host: a rank's segment is
// exported as a CUDA IPC handle, and every same-host peer maps it; kernels
// then store into peers' memory directly (over NVLink between GPUs, or within
// one GPU when several processes share it) and publish with system-scope
// releases. This file only hands the mappings over (peers.h decides who maps
// whom); the copies belong to the kernels (src/kernels).
//
// Legacy cudaIpc* handles are used: on the GPU machine they work between
// processes on one GPU and between GPUs of a host with peer access to each
// other (opening one enables it; the collectives check it first, peers.h),
// and a mapping stays valid after its owner dies (the driver reference-counts
// the allocation), so a survivor's kernel never faults on a dead peer's
// memory; what it must not do is trust that memory's contents, which the
// sequence-numbered signals see to.
//
// Who may open a handle: any process of the host that learns its 64 bytes.
// The handles travel through the group's own exchange (the store is the trust
// boundary, as for the host transports).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mooncake {

constexpr size_t kIpcHandleBytes = 64;

// Device memory owned by this process, zeroed, exportable to peers.
class DeviceSegment {
 public:
  // Throws kSystem (naming the CUDA error) when it cannot allocate.
  DeviceSegment(size_t bytes, int device);
  ~DeviceSegment();
  DeviceSegment(const DeviceSegment&) = delete;
  DeviceSegment& operator=(const DeviceSegment&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  int device() const { return device_; }
  // kIpcHandleBytes bytes that a peer passes to PeerMapping.
  std::string handle() const;

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int device_ = 0;
};

// A peer's DeviceSegment, mapped into this process on `device`.
class PeerMapping {
 public:
  // Throws kPeerFailed when the handle cannot be opened here (another host,
  // a device this process cannot reach, or not a handle at all).
  PeerMapping(const std::string& handle, int device);
  ~PeerMapping();
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
  int device_ = 0;
};

}  // namespace mooncake
