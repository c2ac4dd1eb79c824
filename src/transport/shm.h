// Same-host transport: the peer's segment is mapped here and a write is a
// memcpy into it; liveness is the peer process itself (pidfd).
//
// Who may map a segment is the kernel's call: /proc/<pid>/fd/<fd> opens only
// for a process that may ptrace the owner (the same user, by default), and
// such a process can read and write the owner's memory anyway. What the
// group adds is the seal: the mapping side checks, before it writes a byte,
// that the segment belongs to the slot and incarnation the store names and
// was sealed with the group's secret.
#pragma once

#include <memory>
#include <string_view>

#include "transport/link.h"
#include "transport/segment.h"

namespace mooncake {

// Whether a peer at `addr` can be reached through shared memory from here.
bool shm_can_reach(const PeerAddress& addr);

// Maps the segment of the peer at `addr`. Before anything is written it checks
// that the segment is the one `addr` describes and that it carries the seal
// of the group's `secret` (kSecretBytes hex digits); if not, it throws a
// kPeerFailed Error (the peer's process is gone and its pid was reused, or a
// stale record points outside the group).
std::unique_ptr<PeerLink> shm_connect(const PeerAddress& addr, std::string_view secret);

// Writes this rank's identity and seal (see shm_connect) into the header of
// `segment`, before `me` is published.
void shm_seal(Segment& segment, const PeerAddress& me, std::string_view secret);

// The link to this rank's own segment (a plain memcpy).
std::unique_ptr<PeerLink> self_link(Segment& segment);

}  // namespace mooncake
