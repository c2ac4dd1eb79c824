// The caller's device memory read in place by same-host peers (one copy):
// what a rank publishes of its exported allocations, and what a peer keeps
// of its mappings of them (device/user_memory.h hands them over through
// legacy CUDA IPC). Shared by the high-throughput dispatch (kernels/ep_ht)
// and the device-driven collectives' mapped all_reduce (kernels/coll).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/hd.h"

namespace mooncake::kernels {

constexpr int kXSlots = 8;            // exports per rank (and imports per peer)
constexpr size_t kXExportBytes = 96;  // an XExport, padded
constexpr size_t kIpcBytes = 64;      // a cudaIpcMemHandle_t

// One export, as its owner writes it into its table (gen first and last, so
// that a reader that reads the same non-zero gen before and after has it whole).
struct XExport {
  uint64_t gen;  // 0: empty, or being rewritten
  uint64_t size;
  uint8_t handle[kIpcBytes];
};
static_assert(sizeof(XExport) <= kXExportBytes);

// A peer's mapping of an export (gen 0: none; base null: it cannot be opened
// here, so reading it in place is out and the caller takes its other way
// without a new miss).
struct XImport {
  uint32_t gen = 0, pad = 0;
  const uint8_t* base = nullptr;
  uint64_t size = 0;
};

// A miss the kernels record for the host to map (host-mapped words): the
// export's slot and generation.
MC_HD constexpr uint64_t x_miss(uint32_t slot, uint32_t gen) {
  return (static_cast<uint64_t>(slot) << 32) | gen;
}

}  // namespace mooncake::kernels
