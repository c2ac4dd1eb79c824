// Point-to-point messages with tags and receive-from-any-source.
//
// Sends run on their own thread, so `send` never blocks its caller. A progress
// thread drains every peer's p2p channel as messages arrive: a message that
// matches a posted receive lands straight in its buffer; one that does not yet
// is kept in arrival order until a receive claims it. Messages from one
// source with one tag match receives in order.
//
// What each source may have kept unclaimed is capped
// (MOONCAKE_P2P_UNCLAIMED_BYTES): at the cap the progress thread leaves that
// source's channel alone (neither reads nor acknowledges it), so the source's
// sends wait for a free slot and fail at their deadline unless a receive
// claims what is kept; other sources are unaffected. A message that a receive
// claimed while it was still arriving no longer counts, and its remaining
// chunks flow at the cap. A message whose sender gave up half way (its send
// failed) is dropped when the sender's next message starts, and a receive
// that had taken it fails.
#pragma once

#include <atomic>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/channel.h"
#include "collectives/request.h"
#include "core/error.h"

namespace mooncake {

class P2P {
 public:
  P2P(Channels& channels, int rank, int size, int64_t default_timeout_ms);
  ~P2P();

  // timeout_ms < 0: the default.
  std::shared_ptr<Request> send(const void* data, size_t bytes, int dst, uint64_t tag,
                                int64_t timeout_ms = -1);
  // src < 0: any source; the request's source_rank() tells which.
  std::shared_ptr<Request> recv(void* data, size_t bytes, int src, uint64_t tag,
                                int64_t timeout_ms = -1);
  void stop();
  // The queue sends run on (their requests are its tasks'): a caller that
  // waits for a send through it runs the send itself where the queue's
  // thread has not begun it yet.
  std::weak_ptr<OpQueue> send_queue() const { return sender_; }

  // Bytes kept for messages from `src` that no receive has claimed: their
  // payload so far plus kMessageOverheadBytes each. At most the cap plus one
  // chunk plus kMessageOverheadBytes.
  uint64_t unclaimed_bytes(int src) const;
  // What each unclaimed message counts on top of its payload (its
  // bookkeeping), so that empty messages cannot pile up without bound.
  static constexpr uint64_t kMessageOverheadBytes = 256;

 private:
  struct Posted;
  struct Incoming;
  void progress_loop();
  // Takes every message that has arrived (but from sources at their cap);
  // true when it took any. Progress thread only.
  bool drain();
  // Takes one message; false when `src` is at its cap now (mu_ not held).
  bool on_message(int src, const MsgHeader* msg);
  // Whether the progress thread may take `src`'s next message: under the
  // cap, or the message in flight from `src` is already claimed (or dropped).
  bool may_take(int src);
  bool may_take_locked(int src) const;  // mu_ held
  // The sender of `src`'s message in flight gave up on it (a new message
  // starts): drops it, and returns the receive it was landing in, if any,
  // with the error to fail it with. mu_ held.
  std::optional<std::pair<std::shared_ptr<Posted>, Error>> abandon_in_flight(int src);
  void housekeeping();
  void finish(const std::shared_ptr<Incoming>& in);

  Channels& ch_;
  int rank_;
  int size_;
  int64_t default_timeout_ms_;
  const uint64_t unclaimed_cap_;  // MOONCAKE_P2P_UNCLAIMED_BYTES, per source
  // Sends start at once (their callers rarely wait right away), or on the
  // caller's thread where it waits first (send_queue).
  std::shared_ptr<OpQueue> sender_ = std::make_shared<OpQueue>(0);
  std::mutex mu_;
  std::list<std::shared_ptr<Posted>> posted_;
  std::list<std::shared_ptr<Incoming>> unexpected_;
  std::vector<std::shared_ptr<Incoming>> in_flight_;  // per source
  // Per source: bytes kept for unclaimed messages (see unclaimed_bytes).
  // Written under mu_; read without it where a stale value is only a reason
  // to look again under mu_ (only the progress thread raises it).
  std::unique_ptr<std::atomic<uint64_t>[]> unclaimed_;
  std::atomic<bool> stopping_{false};
  std::thread progress_;
};

}  // namespace mooncake
