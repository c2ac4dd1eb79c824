// Bounds that every layer checks input against, whether it comes from a user,
// the environment or a peer.
#pragma once

#include <cstddef>

namespace mooncake {

// The most slots a group (or an elastic EP buffer) may have.
constexpr int kMaxCapacity = 1 << 20;

// The longest UCX worker address a peer may publish, in hex digits (a worker
// with every transport of a large RDMA node stays under a few KiB).
constexpr size_t kMaxUcxAddressHex = 1 << 16;

}  // namespace mooncake
