// Same-host transport: the peer's segment is mapped here and a write is a
// memcpy into it; liveness is the peer process itself (pidfd).
#pragma once

#include <memory>

#include "transport/link.h"
#include "transport/segment.h"

namespace mooncake {

// Whether a peer at `addr` can be reached through shared memory from here.
bool shm_can_reach(const PeerAddress& addr);

std::unique_ptr<PeerLink> shm_connect(const PeerAddress& addr);

// The link to this rank's own segment (a plain memcpy).
std::unique_ptr<PeerLink> self_link(Segment& segment);

}  // namespace mooncake
