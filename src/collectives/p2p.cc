#include "collectives/p2p.h"

#include <cstring>
#include <optional>

#include "core/error.h"
#include "core/log.h"

namespace mooncake {

namespace {
constexpr uint64_t kUnexpectedReserveBytes = uint64_t{1} << 20;
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
      in_flight_(static_cast<size_t>(size)) {
  progress_ = std::thread([this] { progress_loop(); });
}

P2P::~P2P() {
  stop();
}

void P2P::stop() {
  if (stopping_.exchange(true)) return;
  sender_.stop();
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
  return sender_.submit([this, data, bytes, dst, tag, t] {
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
  std::shared_ptr<Incoming> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool matched = false;
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      auto& in = *it;
      if (in->claimed_by || (src >= 0 && in->src != src) || in->tag != tag) continue;
      in->claimed_by = posted;
      matched = true;
      if (in->complete) {
        ready = in;
        unexpected_.erase(it);
      }
      break;
    }
    if (!matched) posted_.push_back(posted);
  }
  if (ready) finish(ready);
  return posted->request;
}

namespace {

std::exception_ptr size_error(int src, uint64_t tag, uint64_t got, size_t want) {
  return std::make_exception_ptr(
      Error(ErrorKind::kInvalidArgument,
            str("recv: the message from rank ", src, " with tag ", tag, " has ", got,
                " bytes but the tensor has ", want, " bytes")));
}

}  // namespace

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

void P2P::on_message(int src, const MsgHeader* msg) {
  const auto* payload = reinterpret_cast<const uint8_t*>(msg + 1);
  std::shared_ptr<Incoming> in;
  std::shared_ptr<Request> done;  // a receive to complete once unlocked
  std::exception_ptr done_error;
  std::shared_ptr<Incoming> claimed_done;  // an unexpected message whose receive is waiting
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (msg->op_type == 1) {
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
        in->buffer.reserve(std::min<uint64_t>(in->total, kUnexpectedReserveBytes));
        unexpected_.push_back(in);
      }
      in_flight_[src] = in;
    } else {
      in = in_flight_[src];
      MC_ASSERT(in != nullptr, "p2p continuation from rank ", src, " without a first chunk");
    }
    MC_ASSERT(in->got + msg->len <= in->total);
    if (in->posted && msg->len != 0)
      std::memcpy(static_cast<uint8_t*>(in->posted->data) + in->got, payload, msg->len);
    else if (!in->posted && !in->discard)
      in->buffer.insert(in->buffer.end(), payload, payload + msg->len);
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
  }
  if (done) done->complete(done_error);
  if (claimed_done) finish(claimed_done);
}

void P2P::housekeeping() {
  std::vector<std::pair<std::shared_ptr<Posted>, Error>> failed;
  auto verdict = [&](const Posted& p, int src) -> std::optional<Error> {
    if (p.deadline.expired())
      return Error(ErrorKind::kTimeout,
                   p.src >= 0 ? str("recv from rank ", p.src, " with tag ", p.tag, " timed out")
                              : str("recv from any source with tag ", p.tag, " timed out"),
                   p.src);
    if (src < 0) return std::nullopt;
    std::string problem = ch_.peer_problem(src);
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
        if (p == in->claimed_by) unexpected_.remove(in);
        p.reset();
        in->discard = true;  // the rest of it, if it ever comes
      }
    }
  }
  for (auto& [p, e] : failed) p->request->complete(std::make_exception_ptr(e));
}

void P2P::progress_loop() {
  auto any_ready = [&] {
    if (stopping_.load()) return true;
    for (int src = 0; src < size_; ++src)
      if (ch_.poll(src) != nullptr) return true;
    return false;
  };
  int64_t last_housekeeping = now_us();
  while (!stopping_.load()) {
    bool progressed = false;
    for (int src = 0; src < size_; ++src) {
      const MsgHeader* msg;
      while ((msg = ch_.poll(src)) != nullptr) {
        on_message(src, msg);
        try {
          ch_.release(src, Deadline::after_ms(default_timeout_ms_));
        } catch (const Error& e) {
          MC_LOG(kWarn, "p2p: cannot acknowledge a message from rank ", src, ": ", e.what());
        }
        progressed = true;
      }
    }
    if (!progressed) wait_on(ch_.bell(), any_ready, Deadline::after_ms(50));
    if (now_us() - last_housekeeping > 20000) {
      housekeeping();
      last_housekeeping = now_us();
    }
  }
}

}  // namespace mooncake
