// SipHash-2-4 (Aumasson and Bernstein, 2012): a keyed 64-bit hash for short
// messages. The shm transport seals each segment with it, so a peer that maps
// the segment can tell that its owner knows the group's secret (shm.cc). The
// core layer depends on nothing but the standard library, and this is the one
// primitive it needs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake {

uint64_t siphash24(const uint8_t key[16], const void* data, size_t len);

}  // namespace mooncake
