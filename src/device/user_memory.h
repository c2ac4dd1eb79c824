// The caller's device memory (torch's allocations) read in place by the
// kernels of same-host peers: the high-throughput dispatch's one copy
// (kernels/ep_ht/api.h). A source exports the allocation that holds its x
// through a legacy CUDA IPC handle, into a table in its own workspace; a
// dest opens it the first time a dispatch offers it, and keeps it open while
// the source keeps offering it (torch's caching allocator hands the same
// blocks out again, so an engine's steps reuse a few allocations).
//
// An allocation is known by the driver's buffer id, unique in its process:
// one freed and made again at the same address is another allocation, with
// a new export. A dest's mapping keeps the memory it maps alive (the driver
// counts references), so a source that frees an allocation leaves its readers
// nothing to fault on; they map the new one when it is offered.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "device/export_slots.h"
#include "kernels/ep_ht/api.h"

namespace mooncake {

class UserExports {
 public:
  // Exports into `table`: the kXSlots XExports of this rank's workspace (device).
  UserExports(uint8_t* table, int device);

  struct Offer {
    uint32_t gen = 0, slot = 0;  // gen 0: not offered
    int64_t off = 0;
  };
  // [p, p + bytes) offered to the peers: the export of the allocation that
  // holds it (made on its first offer; never under a capture, which a copy
  // would break: there, a new allocation is not offered).
  Offer offer(const void* p, size_t bytes, bool capturing);

 private:
  uint8_t* table_;
  int device_;
  ExportSlots<kernels::ep_ht::kXSlots> slots_;
  std::array<uintptr_t, kernels::ep_ht::kXSlots> base_{};
  std::array<size_t, kernels::ep_ht::kXSlots> size_{};
};

class UserImports {
 public:
  UserImports(int64_t ranks, int device);
  ~UserImports();  // the caller has waited for the device
  UserImports(const UserImports&) = delete;
  UserImports& operator=(const UserImports&) = delete;

  // For the kernels: the mappings (device [R][kXSlots]) and the misses
  // (host-mapped [R][2]).
  const kernels::ep_ht::XImport* table() const { return dev_; }
  uint64_t* misses() const { return misses_dev_; }

  // Maps the exports that earlier launches were offered and could not read:
  // peer s's, from its workspace at `peers[s] + layout.exported(slot)` (null:
  // not mapped). Waits for this device first when it changes the table (a
  // running launch may read it). Nothing under a capture.
  void resolve(const std::vector<const uint8_t*>& peers, const kernels::ep_ht::HtLayout& layout,
               bool capturing);
  // Closes every mapping; the device must be idle (a new set of peers).
  void forget();
  // How many exports are mapped now (tests).
  int mapped() const;

 private:
  void close(kernels::ep_ht::XImport& im);

  int64_t ranks_;
  int device_;
  std::vector<kernels::ep_ht::XImport> host_;  // the table's copy
  kernels::ep_ht::XImport* dev_ = nullptr;
  uint64_t* misses_host_ = nullptr;
  uint64_t* misses_dev_ = nullptr;
};

}  // namespace mooncake
