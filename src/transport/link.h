// The narrow transport interface: a connection from this
// rank to one peer's segment. Algorithms only see this; they never branch on
// which transport serves a peer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/clock.h"

namespace mooncake {

// What a rank publishes about itself so peers can reach it.
struct PeerAddress {
  int rank = -1;
  uint32_t incarnation = 0;  // which process holds the slot: 0 first, then one more per rejoin
  std::string host_key;      // boot id + network and pid namespaces: "same host"
  int pid = 0;
  int segment_fd = -1;
  uint64_t segment_bytes = 0;
  std::string tcp_host;
  std::string ucx_address = "-";  // the UCX worker's address in hex, "-" without one
  int tcp_port = 0;

  friend bool operator==(const PeerAddress&, const PeerAddress&) = default;
  std::string encode() const;
  // Throws an Error (kInternal) naming the field when `text` is malformed;
  // `where` (e.g. " under 'key'") goes into the message.
  static PeerAddress decode(const std::string& text, const std::string& where = "");
};

// This machine's host key.
const std::string& local_host_key();

// A peer's memory as mapped into this process.
struct PeerSpan {
  uint8_t* data = nullptr;
  size_t bytes = 0;
};

// Two shapes of transport sit behind a link. One moves bytes (tcp): the
// data plane hands it what to write, and write() and signal() do the work.
// The other maps the peer's memory here (shm; device memory is mapped by
// the device library, device/ipc.h): mapping() hands the data plane the peer's segment, so that it
// can copy into it the way its memory wants (memcpy, or a kernel or a copy
// on a stream for device memory) without going through write(); signal()
// still publishes, as its ordering rules are the transport's.
class PeerLink {
 public:
  virtual ~PeerLink() = default;
  virtual const char* transport() const = 0;
  // The peer's segment mapped into this process, or an empty span when this
  // transport only moves bytes.
  virtual PeerSpan mapping() { return {}; }
  // One-sided write of `len` bytes into the peer's segment at `offset`.
  virtual void write(size_t offset, const void* src, size_t len, const Deadline& deadline) = 0;
  // Stores `value` into the peer's 64-bit flag at `offset` after every earlier
  // write on this link is visible, then rings the peer's doorbell `bell`.
  virtual void signal(size_t offset, uint64_t value, int bell, const Deadline& deadline) = 0;
  // Like signal, but the flag only ever grows: stores `value` if it is larger
  // than what the flag holds (for words several peers write).
  virtual void signal_max(size_t offset, uint64_t value, int bell, const Deadline& deadline) = 0;
  // False once the peer is known to be gone (process exited, connection closed).
  virtual bool alive() = 0;
  // A counter that moves while the peer process runs (its heartbeat thread),
  // and stands still while it is stopped or hung.
  virtual uint64_t heartbeat() = 0;
  // A file descriptor that becomes readable when the peer process exits
  // (a pidfd), or -1: the heartbeat thread waits on it to notice at once.
  virtual int death_fd() const { return -1; }
  // The peer process's life word (transport/life.h), where this link can see it.
  virtual std::atomic<uint32_t>* life_word() { return nullptr; }
  // Lets the peer know this process runs (called by the heartbeat thread).
  // Transports where the peer reads our segment's counter do nothing.
  virtual void beat() {}
  // Tells the peer that this link is being closed on purpose (a disconnect,
  // not a death), where the transport would otherwise take the close for one.
  virtual void farewell() {}
};

}  // namespace mooncake
