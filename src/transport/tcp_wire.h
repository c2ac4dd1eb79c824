// The tcp transport's wire format, and the checks on everything that arrives.
// A connection carries 24-byte frames; a write frame is followed by its
// payload, a hello by the group's secret. The receiver answers a hello it
// accepts with a welcome naming itself, the only frame that flows back: a
// connect returns only once the process it addressed has answered (a port
// that a dying process still holds, or that another process has taken since,
// is not mistaken for a live peer). FrameDecoder is the receiving side
// of one connection apart from its socket, so that it can be tested and
// fuzzed on plain bytes (tests/fuzz/frame_fuzz.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "transport/secret.h"

namespace mooncake {

enum FrameType : uint32_t {
  kHello = 1,      // offset: incarnations, arg: slots (hello_word), bell: kSecretBytes
  kWrite = 2,      // arg bytes of payload follow, for the segment at offset
  kSignal = 3,     // store arg into the 8-byte flag at offset, then ring bell
  kHeartbeat = 4,  // the sender runs
  kSignalMax = 5,  // like kSignal, but the flag only grows
  kBye = 6,        // the sender closes this connection on purpose: not a death
  kWelcome = 7,    // receiver to sender, once: offset: its incarnation, arg: its slot
};

// A hello's offset and arg: the sender's value in the low half, the value it
// expects of the receiver (its incarnation, its slot) in the high half.
constexpr uint64_t hello_word(uint32_t sender, uint32_t receiver) {
  return uint64_t{sender} | uint64_t{receiver} << 32;
}

struct Frame {
  uint32_t type;
  uint32_t bell;
  uint64_t offset;
  uint64_t arg;
};
static_assert(sizeof(Frame) == 24);

class FrameDecoder {
 public:
  // `base`/`size`: the local segment (whose header holds the doorbells that
  // signals ring); `capacity`: the group's slots; `secret`: kSecretBytes;
  // `rank`/`incarnation`: the local process, whom a hello must address.
  FrameDecoder(uint8_t* base, size_t size, int capacity, std::string_view secret, int rank,
               uint32_t incarnation);

  enum class Step {
    kMore,    // nothing completed
    kFrame,   // a frame of the authenticated peer completed (it shows the peer runs)
    kHello,   // a hello with the right secret: the caller calls accept(), or drops the connection
    kBroken,  // the connection broke the protocol (why() says how): drop it
  };

  // Where the next received bytes go: the rest of the current frame, secret or
  // payload (a write's payload lands in the segment itself). Empty once broken.
  std::span<uint8_t> next();
  // `n` bytes (1 <= n <= next().size()) were placed into next().
  Step advance(size_t n);
  // Takes the hello just reported as this connection's peer.
  void accept();

  bool authenticated() const { return accepted_; }
  int rank() const { return hello_rank_; }  // the hello's slot, -1 before one
  uint32_t incarnation() const { return hello_inc_; }
  bool bye() const { return bye_; }
  const std::string& why() const { return why_; }

 private:
  Step on_frame();
  Step broken(std::string why);

  enum class Part { kHeader, kSecret, kPayload, kBroken };
  uint8_t* base_;
  size_t size_;
  int capacity_;
  std::string_view secret_;
  int rank_;
  uint32_t incarnation_;
  Part part_ = Part::kHeader;
  Frame frame_{};
  size_t got_ = 0;  // bytes of the current part so far
  char secret_got_[kSecretBytes] = {};
  int hello_rank_ = -1;
  uint32_t hello_inc_ = 0;
  bool accepted_ = false;
  bool bye_ = false;
  std::string why_;
};

}  // namespace mooncake
