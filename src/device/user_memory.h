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
// a new export, which its readers map when it is offered. CUDA documents a
// cudaFree of memory another process still maps as undefined; torch frees
// cached allocations (empty_cache, an out-of-memory retry) without telling
// anyone, and a dest closes its mapping of an export only when the slot is
// exported again or the peers change. That is why one copy is off by default
// (MOONCAKE_EP_HT_ONE_COPY): the GPU tests free exported allocations on
// purpose to see what the driver does.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <tuple>
#include <vector>

#include "device/cuda.h"
#include "device/export_slots.h"
#include "kernels/common/exports.h"

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
  // holds it (made on its first offer, written into the table on `stream`;
  // never under a capture: there, a new allocation is not offered).
  Offer offer(const void* p, size_t bytes, cudaStream_t stream, bool capturing);

 private:
  uint8_t* table_;
  int device_;
  ExportSlots<kernels::kXSlots> slots_;
};

class UserImports {
 public:
  UserImports(int64_t ranks, int device);
  ~UserImports();  // the caller has waited for the device
  UserImports(const UserImports&) = delete;
  UserImports& operator=(const UserImports&) = delete;

  // For the kernels: the mappings (device [R][kXSlots]) and the misses
  // (host-mapped [R][2]).
  const kernels::XImport* table() const { return dev_; }
  uint64_t* misses() const { return misses_dev_; }

  // Maps the exports that earlier launches were offered and could not read:
  // peer s's, from its table `table` bytes into its memory as this process
  // maps it (`peers[s]`, null: not mapped; slot i kXExportBytes further each). Before it changes
  // the table it waits for `launches`' last eager one (which may read it), and queues the new table
  // on `stream` (before the next launch); the mappings it replaces are closed at the next change
  // (or by forget()), so a graph's replay must not run across two eager calls of the same buffer
  // (the caller orders replays against eager calls, as LaunchOrder says). A miss of an export that
  // is gone (a captured graph offers what it offered when captured) is remembered and costs nothing
  // again. Nothing under a capture.
  void resolve(const std::vector<const uint8_t*>& peers, size_t table, LaunchOrder& launches,
               cudaStream_t stream, bool capturing);
  // Closes every mapping; the device must be idle (a new set of peers).
  void forget();
  // How many exports are mapped now (tests).
  int mapped() const;

 private:
  void close(kernels::XImport& im);

  int64_t ranks_;
  int device_;
  std::vector<kernels::XImport> host_;             // the table's copy
  std::set<std::tuple<int64_t, uint64_t>> stale_;  // (peer, miss) that map nothing new
  std::vector<kernels::XImport> retired_;  // replaced in the table, closed at the next change
  cudaStream_t reads_ = nullptr;           // the exports' reads (made on the first)
  kernels::XImport* dev_ = nullptr;
  uint64_t* misses_host_ = nullptr;
  uint64_t* misses_dev_ = nullptr;
};

}  // namespace mooncake
