// Bounds that every layer checks input against, whether it comes from a user,
// the environment or a peer.
#pragma once

namespace mooncake {

// The most slots a group (or an elastic EP buffer) may have.
constexpr int kMaxCapacity = 1 << 20;

}  // namespace mooncake
