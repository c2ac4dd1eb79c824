// Point-to-point messages between processes on one host, device to device
// (the torch backend's send and recv of CUDA tensors): the sender copies its
// tensor into a buffer of its own and sends the receiver a note through the
// host's p2p channel (P2PNote: where the bytes lie); the receiver maps the
// buffer, copies the bytes into its tensor, and acknowledges, after which
// the sender lends the buffer out again. A send is so as eager as the host
// path's: it completes once its bytes are in the buffer and the note is out.
//
// The buffers are this library's own (cudaMalloc, exported through a legacy
// CUDA IPC handle), never torch's: a buffer is freed only with the pool, and
// then only where no receiver may still read it (one lent out, its ack not
// back, is left to the process's end), so a peer never maps memory that its
// owner freed while it reads. A receiver keeps a peer buffer mapped once it
// has opened it, until the process ends (its owner lends it out again).
//
// A send never waits for a buffer (its caller may be about to post the recv
// its peer's ack waits for): what is lent grows with the sends not yet
// received, and past kWarnLentBytes a warning says so, once.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace mooncake {

// The note a device-to-device message's sender sends in its place on the
// host channel: 128 bytes, the same layout in every process of a build.
struct P2PNote {
  static constexpr uint64_t kMagic = 0x3270703263636d6bULL;  // a fixed mark
  uint64_t magic = kMagic;
  uint64_t bytes = 0;  // the message's size
  uint64_t id = 0;     // the lent buffer's number at the sender: the ack's tag
  int32_t src = -1;    // the sender's rank (a recv from any source acks it)
  int32_t reserved = 0;
  cudaIpcMemHandle_t handle{};  // the buffer's export
  uint8_t pad[128 - 32 - sizeof(cudaIpcMemHandle_t)] = {};
};
static_assert(sizeof(P2PNote) == 128, "P2PNote is 128 bytes on the wire");

// What a receiver acknowledges (8 bytes): the bytes copied, or refused (the
// receiver's tensor has another size, or the buffer could not be mapped).
enum class P2PAck : uint64_t { kCopied = 1, kRefused = 2 };

// The host channel's tags of a note (a torch tag's) and of the ack of lending
// `id`: their high words are neither 0 nor all ones, so that they match no
// torch tag (an int, widened), nor each other: a note never lands in a recv
// of data (an end that stages meets none: its recv times out).
constexpr uint64_t p2p_note_tag(int tag) {
  return (uint64_t{0x8000'0002} << 32) | static_cast<uint32_t>(tag);
}
constexpr uint64_t p2p_ack_tag(uint64_t id) {
  return (uint64_t{0x8000'0001} << 32) | (id & 0xffff'ffffULL);
}
// (a torch tag widened: high word 0, or all ones when negative)
static_assert(p2p_note_tag(-1) >> 32 != 0xffff'ffffULL && p2p_note_tag(0) >> 32 != 0 &&
                  p2p_ack_tag(~uint64_t{0}) >> 32 != 0xffff'ffffULL &&
                  p2p_note_tag(7) >> 32 != p2p_ack_tag(7) >> 32,
              "p2p note and ack tags must match no torch tag, nor each other");

class P2PBuffers {
 public:
  // Buffers on `device` (current when any method is called).
  explicit P2PBuffers(int device) : device_(device) {}
  // Frees every buffer and closes every mapping (the peers are done).
  ~P2PBuffers();
  P2PBuffers(const P2PBuffers&) = delete;
  P2PBuffers& operator=(const P2PBuffers&) = delete;

  struct Lent {
    void* ptr = nullptr;
    uint64_t id = 0;
    cudaIpcMemHandle_t handle{};
  };
  // A buffer of at least `bytes` (a power of two, at least kMinBytes), lent
  // until give_back(id); made when none is free.
  Lent lend(size_t bytes);
  void give_back(uint64_t id);
  // A lent buffer that may still be read (its ack never came, or its reader
  // failed and might be only stalled): never lent again, nor freed.
  void forget(uint64_t id);

  // A peer's buffer mapped here (opened on first use, kept).
  void* open(const cudaIpcMemHandle_t& handle);

  // Buffers lent now (tests: the acks brought the others back).
  size_t lent() const;

  static constexpr size_t kMinBytes = size_t{1} << 20;
  static constexpr size_t kWarnLentBytes = size_t{1} << 30;

 private:
  struct Buffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    cudaIpcMemHandle_t handle{};
    bool free = true;  // (a forgotten one stays taken)
  };
  const int device_;
  mutable std::mutex mu_;
  std::vector<Buffer> buffers_;
  std::map<uint64_t, size_t> lent_;  // a lending's id -> its buffer
  size_t lent_bytes_ = 0;            // of lent_'s buffers
  bool warned_ = false;
  uint64_t next_id_ = 1;
  std::map<std::string, void*> opened_;  // a peer handle's bytes -> its mapping
};

}  // namespace mooncake
