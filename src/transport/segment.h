// The local memory region that peers write into. It is backed by a memfd so a
// peer on the same host can map it through /proc/<pid>/fd/<fd>: no name in
// /dev/shm, so nothing is left behind when a process dies. Its first bytes
// hold the doorbells that signals ring; the rest is laid out by the layer
// above (collectives/layout.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/wait.h"

namespace mooncake {

constexpr int kNumBells = 4;  // one per plane (collectives, p2p, ...)
constexpr int kNumHints = 2;  // see SegmentHeader::hints
constexpr size_t kSegmentHeaderBytes = 128;

struct SegmentHeader {
  Doorbell bells[kNumBells];
  // Bumped by the owner's heartbeat thread while its process runs: a peer
  // that sees it stand still knows the process is stopped, not just slow.
  std::atomic<uint64_t> heartbeat{0};
  // Held by the owner's heartbeat thread (transport/life.h): the kernel marks
  // it the moment that thread dies, before the process's memory is torn down.
  std::atomic<uint32_t> life{0};
  // Set by the owner as it closes the segment (its Endpoint is destroyed)
  // while its process may live on: a peer then takes it for gone at once, as
  // a tcp peer's close without a farewell, instead of at the hang limit.
  std::atomic<uint32_t> closed{0};
  // Words that peers raise (never lower) to tell this process something while
  // it waits or idles (Endpoint::post_hint). The transport only carries them:
  // the layer above says what each one means.
  std::atomic<uint64_t> hints[kNumHints] = {};
  // Who owns the segment, written before its address is published: a peer
  // that maps it checks these against the store's record, and the seal
  // against the group's secret, before it writes anything (shm.cc).
  uint32_t owner_rank = 0;
  uint32_t owner_incarnation = 0;
  uint64_t nonce = 0;  // random, per segment
  uint64_t seal = 0;
};
static_assert(sizeof(SegmentHeader) <= kSegmentHeaderBytes);

// Where hint word `slot` (in [0, kNumHints)) sits in a segment.
constexpr size_t hint_offset(int slot) {
  return offsetof(SegmentHeader, hints) + static_cast<size_t>(slot) * sizeof(uint64_t);
}

class Segment {
 public:
  explicit Segment(size_t bytes);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  uint8_t* base() const { return base_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  Doorbell* bell(int i) const { return &reinterpret_cast<SegmentHeader*>(base_)->bells[i]; }

 private:
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

// Maps file descriptor `fd` of process `pid` (same host), opened through
// /proc, shared, for reading and writing: `bytes` bytes, which the caller
// munmaps. Throws (kPeerFailed) where that is not a regular file of `bytes`
// bytes (the process may be gone and its pid taken by another); `what` names
// it in the message.
void* map_peer_file(int pid, int fd, size_t bytes, const char* what);

// Maps another process's segment (same host). RAII. Refuses (kPeerFailed)
// a file that is not a segment of `bytes` bytes: the process the store
// names may be gone and its pid taken by another.
class RemoteMapping {
 public:
  RemoteMapping(int pid, int fd, size_t bytes);
  ~RemoteMapping();
  RemoteMapping(const RemoteMapping&) = delete;
  RemoteMapping& operator=(const RemoteMapping&) = delete;
  uint8_t* base() const { return base_; }
  size_t size() const { return size_; }

 private:
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
};

// Release-ordered 64-bit flag store / acquire load in (shared) memory.
inline void store_flag(uint8_t* base, size_t offset, uint64_t value) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(base + offset), value, __ATOMIC_RELEASE);
}
inline void store_flag_max(uint8_t* base, size_t offset, uint64_t value) {
  auto* word = reinterpret_cast<uint64_t*>(base + offset);
  uint64_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  while (seen < value && !__atomic_compare_exchange_n(word, &seen, value, true, __ATOMIC_RELEASE,
                                                      __ATOMIC_ACQUIRE)) {
  }
}
inline uint64_t load_flag(const uint8_t* base, size_t offset) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(base + offset), __ATOMIC_ACQUIRE);
}

}  // namespace mooncake
