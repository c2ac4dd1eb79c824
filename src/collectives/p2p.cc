#include "collectives/p2p.h"

#include <algorithm>
#include <cstring>

#include "core/env.h"
#include "core/log.h"
#include "core/thread.h"

namespace mooncake {

namespace {

constexpr uint64_t kUnexpectedReserveBytes = uint64_t{1} << 20;

uint64_t unclaimed_cap_from_env() {
  const int64_t cap = env_int("MOONCAKE_P2P_UNCLAIMED_BYTES");
  MC_CHECK_ARG(cap > 0, "MOONCAKE_P2P_UNCLAIMED_BYTES must be > 0, got ", cap);
  return static_cast<uint64_t>(cap);
}

std::exception_ptr size_error(int src, uint64_t tag, uint64_t got, size_t want) {
  return std::make_exception_ptr(
      Error(ErrorKind::kInvalidArgument,
            str("recv: the message from rank ", src, " with tag ", tag, " has ", got,
                " bytes but the tensor has ", want, " bytes")));
}

// Appends a chunk to a message kept until a receive claims it. Grows like a
// vector, but never past the message's size: a complete message holds no
// more than its bytes.
void append(std::vector<uint8_t>& buffer, uint64_t total, const uint8_t* data, size_t len) {
  if (buffer.size() + len > buffer.capacity())
    buffer.reserve(
        std::min<uint64_t>(total, std::max<uint64_t>(buffer.size() + len, 2 * buffer.capacity())));
  buffer.insert(buffer.end(), data, data + len);
}

}  // namespace

struct P2P::Posted {
  void* data;
  size_t bytes;
  int src;
  uint64_t tag;
  Deadline deadline;
  std::shared_ptr<Request> request;
};

struct P2P::Incoming {
  int src;
  uint64_t tag;
  uint64_t total;
  uint64_t got = 0;
  std::vector<uint8_t> buffer;     // when no receive matched on arrival
  std::shared_ptr<Posted> posted;  // the receive it is landing in, if any
  bool complete = false;
  std::shared_ptr<Posted> claimed_by;  // a receive that claimed it while in flight
  bool discard = false;                // the rest of a wrong-sized message
};

P2P::P2P(Channels& channels, int rank, int size, int64_t default_timeout_ms)
    : ch_(channels),
      rank_(rank),
      size_(size),
      default_timeout_ms_(default_timeout_ms),
      unclaimed_cap_(unclaimed_cap_from_env()),
      in_flight_(static_cast<size_t>(size)),
      unclaimed_(std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(size))) {
  progress_ = std::thread([this] {
    begin_library_thread("mc-p2p");
    progress_loop();
  });
}

P2P::~P2P() {
  stop();
}

void P2P::stop() {
  if (stopping_.exchange(true)) return;
  sender_->stop();
  ring(ch_.bell());
  if (progress_.joinable()) progress_.join();
  std::list<std::shared_ptr<Posted>> posted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    posted.swap(posted_);
  }
  for (auto& p : posted)
    p->request->complete(std::make_exception_ptr(
        Error(ErrorKind::kPeerFailed, "recv: the process group was shut down")));
}

std::shared_ptr<Request> P2P::send(const void* data, size_t bytes, int dst, uint64_t tag,
                                   int64_t timeout_ms) {
  MC_CHECK_ARG(dst >= 0 && dst < size_, "send: dst rank must be in [0, ", size_, "), got ", dst);
  const int64_t t = timeout_ms >= 0 ? timeout_ms : default_timeout_ms_;
  return sender_->submit([this, data, bytes, dst, tag, t] {
    // Over shared memory a write into a dead process's segment would "succeed".
    const std::string problem = ch_.peer_problem(dst);
    if (!problem.empty()) throw Error(ErrorKind::kPeerFailed, str("send: ", problem), dst);
    Deadline deadline = Deadline::after_ms(t);
    const size_t chunk = ch_.layout().chunk_bytes;
    MsgHeader h{};
    h.op_seq = tag;
    h.numel = bytes;
    size_t done = 0;
    do {
      size_t len = std::min(chunk, bytes - done);
      h.op_type = done == 0 ? 1 : 0;
      ch_.send(dst, h, static_cast<const uint8_t*>(data) + done, len, deadline, "send");
      done += len;
    } while (done < bytes);
  });
}

std::shared_ptr<Request> P2P::recv(void* data, size_t bytes, int src, uint64_t tag,
                                   int64_t timeout_ms) {
  MC_CHECK_ARG(src < size_, "recv: src rank must be in [0, ", size_, ") or any, got ", src);
  auto posted = std::make_shared<Posted>();
  posted->data = data;
  posted->bytes = bytes;
  posted->src = src;
  posted->tag = tag;
  posted->deadline = Deadline::after_ms(timeout_ms >= 0 ? timeout_ms : default_timeout_ms_);
  posted->request = std::make_shared<Request>();
  if (stopping_.load()) {
    posted->request->complete(std::make_exception_ptr(
        Error(ErrorKind::kPeerFailed, "recv: the process group was shut down")));
    return posted->request;
  }
  std::shared_ptr<Incoming> ready;       // complete: copy it out
  std::shared_ptr<Incoming> wrong_size;  // still arriving, and of the wrong size
  bool wake = false;                     // its source was at the cap and no longer is
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool matched = false;
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      std::shared_ptr<Incoming> in = *it;
      if (in->claimed_by || (src >= 0 && in->src != src) || in->tag != tag) continue;
      matched = true;
      const bool was_blocked = !may_take_locked(in->src);
      unclaimed_[in->src].fetch_sub(kMessageOverheadBytes + in->got);
      if (in->complete) {
        in->claimed_by = posted;
        ready = in;
        unexpected_.erase(it);
      } else if (in->total != bytes) {
        // Fail now rather than keep the rest of a message no receive can take.
        unexpected_.erase(it);
        in->discard = true;
        std::vector<uint8_t>().swap(in->buffer);
        wrong_size = in;
      } else {
        in->claimed_by = posted;  // its remaining chunks flow even at the cap
      }
      wake = was_blocked && may_take_locked(in->src);
      break;
    }
    if (!matched) posted_.push_back(posted);
  }
  if (wake) ring(ch_.bell());
  if (ready) finish(ready);
  if (wrong_size) {
    posted->request->set_source_rank(wrong_size->src);
    posted->request->complete(
        size_error(wrong_size->src, wrong_size->tag, wrong_size->total, bytes));
  }
  return posted->request;
}

uint64_t P2P::unclaimed_bytes(int src) const {
  MC_CHECK_ARG(src >= 0 && src < size_, "unclaimed_bytes: src rank must be in [0, ", size_,
               "), got ", src);
  return unclaimed_[src].load();
}

bool P2P::may_take(int src) {
  // Only the progress thread (the caller) raises the count: below the cap
  // here means below it now.
  if (unclaimed_[src].load(std::memory_order_relaxed) < unclaimed_cap_) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return may_take_locked(src);
}

bool P2P::may_take_locked(int src) const {
  if (unclaimed_[src].load(std::memory_order_relaxed) < unclaimed_cap_) return true;
  const std::shared_ptr<Incoming>& in = in_flight_[src];
  return in && (in->posted || in->claimed_by || in->discard);
}

std::optional<std::pair<std::shared_ptr<P2P::Posted>, Error>> P2P::abandon_in_flight(int src) {
  std::shared_ptr<Incoming> in = std::move(in_flight_[src]);
  if (!in) return std::nullopt;
  const bool kept = !in->posted && !in->discard;  // in unexpected_
  if (kept) unexpected_.remove(in);
  if (kept && !in->claimed_by) unclaimed_[src].fetch_sub(kMessageOverheadBytes + in->got);
  std::shared_ptr<Posted> p = in->posted ? in->posted : in->claimed_by;
  if (!p) return std::nullopt;
  return std::make_pair(
      p, Error(ErrorKind::kTimeout,
               str("recv: rank ", src, " gave up sending the message with tag ", in->tag, " after ",
                   in->got, " of ", in->total, " bytes (its send failed)"),
               src));
}

// Copies a completed unexpected message into the receive that claimed it and
// completes that receive. Called without mu_ held.
void P2P::finish(const std::shared_ptr<Incoming>& in) {
  auto& p = in->claimed_by;
  p->request->set_source_rank(in->src);
  if (in->total != p->bytes)
    return p->request->complete(size_error(in->src, in->tag, in->total, p->bytes));
  if (in->total != 0) std::memcpy(p->data, in->buffer.data(), in->total);
  p->request->complete();
}

bool P2P::on_message(int src, const MsgHeader* msg) {
  const auto* payload = reinterpret_cast<const uint8_t*>(msg + 1);
  std::shared_ptr<Incoming> in;
  std::shared_ptr<Request> done;  // a receive to complete once unlocked
  std::exception_ptr done_error;
  std::shared_ptr<Incoming> claimed_done;  // an unexpected message whose receive is waiting
  std::optional<std::pair<std::shared_ptr<Posted>, Error>> abandoned;
  bool more;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (msg->op_type == 1) {
      // One message at a time per source: one still in flight was given up
      // by its sender.
      abandoned = abandon_in_flight(src);
      in = std::make_shared<Incoming>();
      in->src = src;
      in->tag = msg->op_seq;
      in->total = msg->numel;
      for (auto it = posted_.begin(); it != posted_.end(); ++it) {
        if (((*it)->src >= 0 && (*it)->src != src) || (*it)->tag != in->tag) continue;
        in->posted = *it;
        posted_.erase(it);
        break;
      }
      if (in->posted && in->posted->bytes != in->total) {
        // Wrong size: fail that receive now and drop the message's bytes.
        in->posted->request->set_source_rank(src);
        done = in->posted->request;
        done_error = size_error(src, in->tag, in->total, in->posted->bytes);
        in->posted.reset();
        in->discard = true;
      } else if (!in->posted) {
        // Grown as chunks arrive, never sized from the header alone: a peer
        // cannot make this rank allocate more than it actually sends.
        in->buffer.reserve(std::min({in->total, kUnexpectedReserveBytes, unclaimed_cap_}));
        unexpected_.push_back(in);
        unclaimed_[src].fetch_add(kMessageOverheadBytes);
      }
      in_flight_[src] = in;
    } else {
      in = in_flight_[src];
      MC_ASSERT(in != nullptr, "p2p continuation from rank ", src, " without a first chunk");
    }
    MC_ASSERT(in->got + msg->len <= in->total);
    if (in->posted && msg->len != 0)
      std::memcpy(static_cast<uint8_t*>(in->posted->data) + in->got, payload, msg->len);
    else if (!in->posted && !in->discard) {
      append(in->buffer, in->total, payload, msg->len);
      if (!in->claimed_by) unclaimed_[src].fetch_add(msg->len);
    }
    in->got += msg->len;
    if (in->got == in->total) {
      in_flight_[src].reset();
      in->complete = true;
      if (in->posted) {
        in->posted->request->set_source_rank(src);
        done = in->posted->request;
      } else if (in->claimed_by) {
        unexpected_.remove(in);
        claimed_done = in;
      }
    }
    more = may_take_locked(src);
  }
  if (abandoned) {
    abandoned->first->request->set_source_rank(src);
    abandoned->first->request->complete(std::make_exception_ptr(abandoned->second));
  }
  if (done) done->complete(done_error);
  if (claimed_done) finish(claimed_done);
  return more;
}

void P2P::housekeeping() {
  // The peers' problems first, then what they sent: a peer that posted its
  // message and exited since the last drain is seen gone with the message
  // here, which the drain takes before its receive could be failed.
  std::vector<std::string> problems(static_cast<size_t>(size_));
  {
    std::vector<uint8_t> waited_on(static_cast<size_t>(size_), 0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& p : posted_)
        if (p->src >= 0) waited_on[static_cast<size_t>(p->src)] = 1;
      for (const auto& in : in_flight_)
        if (in && (in->posted || in->claimed_by)) waited_on[static_cast<size_t>(in->src)] = 1;
    }
    for (int src = 0; src < size_; ++src)
      if (waited_on[static_cast<size_t>(src)])
        problems[static_cast<size_t>(src)] = ch_.peer_problem(src);
  }
  drain();
  std::vector<std::pair<std::shared_ptr<Posted>, Error>> failed;
  auto verdict = [&](const Posted& p, int src) -> std::optional<Error> {
    if (p.deadline.expired())
      return Error(ErrorKind::kTimeout,
                   p.src >= 0 ? str("recv from rank ", p.src, " with tag ", p.tag, " timed out")
                              : str("recv from any source with tag ", p.tag, " timed out"),
                   p.src);
    if (src < 0) return std::nullopt;
    const std::string& problem = problems[static_cast<size_t>(src)];
    if (problem.empty()) return std::nullopt;
    return Error(ErrorKind::kPeerFailed, str("recv: ", problem), src);
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = posted_.begin(); it != posted_.end();) {
      if (auto e = verdict(**it, (*it)->src)) {
        failed.emplace_back(*it, *e);
        it = posted_.erase(it);
      } else {
        ++it;
      }
    }
    // Receives already landing a message: its sender may die (or stall) half
    // way. Either the receive was posted first (`posted`) or it claimed a
    // message that had started to arrive unexpected (`claimed_by`).
    for (auto& in : in_flight_) {
      if (!in) continue;
      std::shared_ptr<Posted>& p = in->posted ? in->posted : in->claimed_by;
      if (!p) continue;
      if (auto e = verdict(*p, in->src)) {
        failed.emplace_back(p, *e);
        if (p == in->claimed_by) {
          unexpected_.remove(in);
          std::vector<uint8_t>().swap(in->buffer);
        }
        p.reset();
        in->discard = true;  // the rest of it, if it ever comes
      }
    }
  }
  for (auto& [p, e] : failed) p->request->complete(std::make_exception_ptr(e));
}

void P2P::progress_loop() {
  // A source at its cap is left alone: its message is not ready for us.
  auto any_ready = [&] {
    if (stopping_.load()) return true;
    for (int src = 0; src < size_; ++src)
      if (may_take(src) && ch_.poll(src) != nullptr) return true;
    return false;
  };
  int64_t last_housekeeping = now_us();
  while (!stopping_.load()) {
    if (!drain()) wait_on(ch_.bell(), any_ready, Deadline::after_ms(50));
    if (now_us() - last_housekeeping > 20000) {
      housekeeping();
      last_housekeeping = now_us();
    }
  }
}

bool P2P::drain() {
  bool progressed = false;
  for (int src = 0; src < size_; ++src) {
    bool gone = false;
    if (!may_take(src)) {
      // At the cap a source's sends wait for a receive. One that is gone
      // sends no more: what it left in the channel (no more than the
      // channel holds) is taken, for receives that come for it.
      if (ch_.endpoint().alive(src)) continue;
      gone = true;
    }
    const MsgHeader* msg;
    while ((msg = ch_.poll(src)) != nullptr) {
      const bool more = on_message(src, msg) || gone;
      try {
        ch_.release(src, Deadline::after_ms(default_timeout_ms_));
      } catch (const Error& e) {
        MC_LOG(kWarn, "p2p: cannot acknowledge a message from rank ", src, ": ", e.what());
      }
      progressed = true;
      if (!more) break;
    }
  }
  return progressed;
}

}  // namespace mooncake
