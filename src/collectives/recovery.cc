// The Communicator's membership side: running an op to completion across
// failures (run/recover), handing on results, and admitting new processes.
// See "Failures" in communicator.h and membership/agreement.h.
#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>

#include "collectives/communicator.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/log.h"
#include "core/record.h"
#include "membership/agreement.h"
#include "membership/hints.h"

namespace mooncake {

namespace {

// Re-runs among unchanged members before an op is given up as timed out.
constexpr int kMaxStalledAttempts = 2;
// How long members have to answer a recovery's announcement once the op's
// own deadline has passed (capped by the op's timeout).
constexpr int64_t kReportGraceMs = 500;

}  // namespace

void Communicator::run(OpMeta& meta, Finish finish, const std::vector<Region>& outputs,
                       Region inplace, const std::function<void()>& attempt) {
  const bool recover_on = config_.recover != 0;
  // The input a re-run needs, in a buffer kept across ops (no page faults).
  const bool keep_input = recover_on && inplace.bytes != 0;
  if (keep_input) {
    if (saved_input_.size() < inplace.bytes) saved_input_.resize(inplace.bytes);
    std::memcpy(saved_input_.data(), inplace.ptr, inplace.bytes);
  }
  // Errors that end the op: bad arguments, a dead root, this rank left out
  // (kLeftOut, from the agreement: never peer_or_timeout), shutting down.
  auto final_error = [&](const Error& e) {
    return !recover_on || !e.peer_or_timeout() || stopping_.load() || e.peer() == rank_ ||
           (meta.root >= 0 && e.peer() == meta.root && !view_.is_member(meta.root));
  };
  for (int attempt_no = 0;; ++attempt_no) {
    if (attempt_no > 0) {
      if (keep_input) std::memcpy(inplace.ptr, saved_input_.data(), inplace.bytes);
      meta.deadline = Deadline::after_ms(meta.timeout_ms);
    }
    std::optional<Error> failure;
    try {
      check_not_left_behind();  // a recovery started while this rank was away
      if (meta.root >= 0 && meta.local_error.empty() && !view_.is_member(meta.root)) {
        // Said in step with the others: one exchange of headers, so a member
        // that named a live root gets a mismatch instead of waiting for this
        // rank, and every member's op count stays the same.
        exchange(meta, Plan(capacity_), false);
        throw_error(ErrorKind::kPeerFailed, meta.root, meta.name, ": root rank ", meta.root,
                    " has failed; the active ranks are ", view_.describe(), " (no data to return)");
      }
      attempt();
      if (finish == Finish::kCommit && members_.size() > 1)
        exchange(meta, Plan(capacity_), false);  // the commit round
      check_not_left_behind();
    } catch (const Error& e) {
      // Stale messages from an abandoned attempt can look like a mismatch to
      // a rank that was left out: it learns so first. A peer failure, not
      // kLeftOut: the agreement it leads to decides whether this rank is out.
      if (e.kind() == ErrorKind::kInvalidArgument && agreement_called(*endpoint_, view_.epoch)) {
        failure = Error(ErrorKind::kPeerFailed, "the group has moved on without this rank");
      } else if (final_error(e)) {
        finished(meta.seq, nullptr, true);
        throw;
      } else {
        failure = e;
      }
    }
    bool completed = !failure;
    while (failure) {  // recovering may meet failures of its own
      MC_LOG(kInfo, meta.name, " #", meta.seq, " failed at epoch ", view_.epoch, ": ",
             failure->what());
      try {
        completed = recover(meta, finish, outputs, *failure, attempt_no);
        failure.reset();
      } catch (const Error& e) {
        if (final_error(e)) {
          finished(meta.seq, nullptr, true);
          throw;
        }
        failure = e;
      }
    }
    if (!completed) continue;
    finished(meta.seq, finish == Finish::kForward ? &outputs : nullptr, false);
    return;
  }
}

// A recovery was called at this rank's epoch (or one left it out): a peer
// failure, to recover from; the agreement says whether this rank is left out.
void Communicator::check_not_left_behind() {
  if (agreement_called(*endpoint_, view_.epoch))
    throw_error(ErrorKind::kPeerFailed, -1, "the members of epoch ", view_.epoch,
                " are agreeing on a new view (a member failed)");
}

void Communicator::finished(uint64_t seq, const std::vector<Region>* result, bool failed) {
  done_seq_ = seq;
  done_failed_ = failed;
  has_kept_ = result != nullptr;
  if (!has_kept_) return;
  kept_seq_ = seq;
  kept_.clear();
  for (const Region& r : *result) {
    const auto* p = static_cast<const uint8_t*>(r.ptr);
    kept_.insert(kept_.end(), p, p + r.bytes);
  }
}

bool Communicator::recover(const OpMeta& meta, Finish finish, const std::vector<Region>& outputs,
                           const Error& cause, int attempts) {
  Report mine;
  mine.rank = rank_;
  mine.pending = meta.seq;
  mine.done = done_seq_;
  mine.has_result = has_kept_ && kept_seq_ == done_seq_;
  mine.failed = done_failed_;
  mine.attempts = attempts;
  auto responsive = [&](int q) { return coll_->peer_problem(q).empty(); };
  const int before = view_.num_members();
  // Members that are not in an op, or wait for one that cannot complete,
  // learn at once that a recovery is on and come to report.
  for (int p : members_)
    if (p != rank_) announce_recovery(*endpoint_, p, view_.epoch);
  // Members have until the op's own deadline to show up, the rule the op
  // itself follows, and a short grace beyond it to answer: a rank that never
  // calls the op is left out about one timeout after the op began, not two.
  const Deadline until =
      meta.deadline.latest(Deadline::after_ms(std::min(meta.timeout_ms, kReportGraceMs)));
  Decision d = agree_on_view(store_, prefix_, view_, mine, responsive, until);
  apply(d.view);
  // The op to settle is the earliest pending one; a member ahead of it has
  // completed it (ops complete in order and need every member).
  uint64_t c = meta.seq;
  for (const Report& r : d.reports) c = std::min(c, r.pending);
  int source = -1;
  bool completed_somewhere = false, failed_somewhere = false;
  for (const Report& r : d.reports) {
    if (r.done < c) continue;
    completed_somewhere = true;
    failed_somewhere |= r.failed;
    if (r.has_result && source < 0) source = r.rank;
  }
  if (!completed_somewhere) {
    // Nobody completed it: everyone re-runs it, unless it has been re-run
    // again and again among the same members (it cannot complete in its
    // timeout). Decided from the reports, so every member decides alike.
    int most = 0;
    for (const Report& r : d.reports) most = std::max(most, r.attempts);
    if (d.view.num_members() == before && most >= kMaxStalledAttempts) {
      finished(meta.seq, nullptr, true);
      throw_error(ErrorKind::kTimeout, -1, meta.name, ": did not complete within its timeout (",
                  meta.timeout_ms, " ms) in ", most + 1, " attempts among the same ", before,
                  " ranks (last: ", cause.what(), ")");
    }
    return false;
  }
  if (meta.seq == c && failed_somewhere) {
    // It ended in an error where it completed (a rank rejected its arguments).
    finished(meta.seq, nullptr, true);
    throw_error(ErrorKind::kInvalidArgument, -1, meta.name,
                ": the op failed on the other ranks (a rank rejected its arguments) while this "
                "rank was cut off by a failure");
  }
  if (meta.seq == c) {
    // Behind: op c completed elsewhere. With kCommit every member had all of
    // its data before anyone completed; with kForward a completed rank hands
    // its result on.
    if (finish == Finish::kForward) {
      MC_ASSERT(source >= 0, meta.name, " #", c, " completed on some rank but none kept it");
      receive_result(meta, source, outputs);
    }
    return true;
  }
  // Ahead: this rank completed c; the first one that kept c's result hands it on.
  if (source == rank_)
    for (const Report& r : d.reports)
      if (r.pending == c) send_result(c, r.rank, Deadline::after_ms(meta.timeout_ms));
  return false;
}

void Communicator::send_result(uint64_t seq, int to, const Deadline& deadline) {
  const size_t chunk = coll_->layout().chunk_bytes;
  MsgHeader h{};
  h.op_seq = seq;
  h.op_type = static_cast<uint32_t>(OpType::kForward);
  h.numel = kept_.size();
  size_t at = 0;
  do {
    const size_t len = std::min(chunk, kept_.size() - at);
    coll_->send(to, h, kept_.data() + at, len, deadline, "recovery");
    at += len;
  } while (at < kept_.size());
}

void Communicator::receive_result(const OpMeta& meta, int from,
                                  const std::vector<Region>& outputs) {
  size_t total = 0;
  for (const Region& r : outputs) total += r.bytes;
  size_t at = 0, region = 0, region_at = 0;
  do {
    const MsgHeader* msg = coll_->receive(from, meta.deadline, meta.name);
    MC_ASSERT(msg->op_type == static_cast<uint32_t>(OpType::kForward) && msg->op_seq == meta.seq &&
                  msg->numel == total,
              meta.name, ": rank ", from, " handed on a result of op #", msg->op_seq, " (",
              msg->numel, " bytes), expected #", meta.seq, " (", total, " bytes)");
    const auto* p = reinterpret_cast<const uint8_t*>(msg + 1);
    size_t left = msg->len;
    while (left > 0) {
      const size_t n = std::min(left, outputs[region].bytes - region_at);
      std::memcpy(static_cast<uint8_t*>(outputs[region].ptr) + region_at, p, n);
      p += n;
      left -= n;
      region_at += n;
      if (region_at == outputs[region].bytes) {
        ++region;
        region_at = 0;
      }
    }
    at += msg->len;
    coll_->release(from, meta.deadline);
  } while (at < total);
}

void Communicator::apply(const View& view) {
  const std::vector<int> before = members_;
  {
    std::lock_guard<std::mutex> lock(view_mu_);
    view_ = view;
    members_ = view.members();
  }
  for (int p : before) {
    if (view.is_member(p)) continue;
    announce_left_out(*endpoint_, p, view.epoch);  // it learns so, if it lives
    endpoint_->disconnect(p);
  }
  for (int p : members_) coll_->restart(p, view.collective_gen(rank_, p));
  coll_->set_watched(members_, view.epoch);
  if (on_view_) on_view_(view);
}

void Communicator::connect_new(const View& view, const std::vector<int>& slots,
                               const Deadline& deadline) {
  for (int q : slots) {
    if (q == rank_ || !view.is_member(q)) continue;
    try {
      endpoint_->connect(q, view.incarnation[q], deadline);
    } catch (const Error& e) {
      MC_LOG(kWarn, "membership: cannot connect to rank ", q, ": ", e.what());
      endpoint_->disconnect(q);
    }
    p2p_->restart(q, view.p2p_gen(rank_, q));
  }
}

int64_t Communicator::waiting_incarnation(int slot, int64_t* capacity) {
  const std::string key = prefix_ + "waiting/" + std::to_string(slot);
  if (!store_.check(key)) return -1;
  RecordReader in(store_.get(key, 1000), "joiner record under '" + key + "'");
  const int64_t inc = in.number<uint32_t>("incarnation");
  const int64_t cap = in.number<int>("max_world_size", 1, kMaxCapacity);
  in.end();
  if (capacity != nullptr) *capacity = cap;
  return inc > view_.incarnation[slot] ? inc : -1;
}

std::vector<uint8_t> Communicator::peer_state(const std::vector<int>& slots, int64_t timeout_ms) {
  std::vector<uint8_t> ready(slots.size(), 0);
  for (size_t i = 0; i < slots.size(); ++i) {
    const int q = slots[i];
    MC_CHECK_ARG(q >= 0 && q < capacity_, "get_peer_state: ranks must be in [0, ",
                 "max_world_size=", capacity_, "), got ", q);
    ready[i] = !view_.is_member(q) && waiting_incarnation(q) >= 0;
  }
  if (!ready.empty())
    all_reduce(ready.data(), ready.size(), DType::kUInt8, RedOp::kMin, timeout_ms);
  return ready;
}

void Communicator::admit(const std::vector<int>& slots, int64_t timeout_ms, bool wait, int limit) {
  MC_CHECK_ARG(!slots.empty(), "recover_ranks: ranks is empty");
  // Settles failures first, so that a rank that died since the last op is
  // out of the view and can be admitted again.
  barrier(timeout_ms);
  const Deadline deadline = Deadline::after_ms(timeout_ms >= 0 ? timeout_ms : config_.timeout_ms);
  std::string error;
  std::vector<uint32_t> incs;
  uint64_t digest = 1469598103934665603ull;  // FNV-1a over (slot, incarnation) pairs
  for (size_t i = 0; i < slots.size() && error.empty(); ++i) {
    const int q = slots[i];
    int64_t inc = -1;
    if (q < 0 || q >= capacity_)
      error = str("recover_ranks: ranks must be in [0, max_world_size=", capacity_, "), got ", q);
    else if (std::count(slots.begin(), slots.end(), q) > 1)
      error = str("recover_ranks: rank ", q, " is named twice");
    else if (view_.is_member(q))
      error = str("recover_ranks: rank ", q,
                  " is active; only failed or never-used ranks can be recovered");
    else if (limit >= 0 && q >= limit)
      error = str("recover_ranks: rank ", q, " is beyond the group's size (", limit,
                  "): call extend_group_size_to on every healthy rank first");
    int64_t cap = -1;
    while (error.empty() && (inc = waiting_incarnation(q, &cap)) < 0) {
      if (!wait || deadline.expired()) {
        error = str("recover_ranks: no process waits to join as rank ", q,
                    " (start one with is_extension=True; poll get_peer_state until it is ready)");
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (error.empty() && cap != capacity_) {
      error = str("recover_ranks: the process waiting to join as rank ", q,
                  " was created with max_world_size=", cap, ", but this group's is ", capacity_,
                  "; start it with max_world_size=", capacity_);
      // It learns so too, instead of waiting out its timeout.
      store_.set(prefix_ + "refused/" + std::to_string(q) + "/" + std::to_string(inc), error);
    }
    incs.push_back(static_cast<uint32_t>(inc));
    for (uint64_t v : {static_cast<uint64_t>(q), static_cast<uint64_t>(inc)})
      digest = (digest ^ v) * 1099511628211ull;
  }
  OpMeta meta = begin(OpType::kAdmit, DType::kUInt8, RedOp::kSum, -1, digest, timeout_ms, error);
  run(meta, Finish::kCommit, {}, {}, [&] { exchange(meta, Plan(capacity_), false); });
  View next = view_;
  next.epoch += 1;
  next.seq = meta.seq;
  for (size_t i = 0; i < slots.size(); ++i) {
    next.active[slots[i]] = 1;
    next.incarnation[slots[i]] = incs[i];
    next.since[slots[i]] = next.epoch;
  }
  // A newcomer listens before it says it waits: one that cannot be reached
  // within a second is gone, and the next op finds it out.
  connect_new(next, slots, Deadline::after_ms(std::min<int64_t>(meta.timeout_ms, 1000)));
  for (size_t i = 0; i < slots.size(); ++i)
    store_.set(prefix_ + "admitted/" + std::to_string(slots[i]) + "/" + std::to_string(incs[i]),
               next.encode());
  apply(next);
}

void Communicator::join(int64_t timeout_ms) {
  MC_CHECK_ARG(joining_,
               "join_group: this process is already a member (join_group is for "
               "processes created with is_extension=True)");
  const int64_t t = timeout_ms >= 0 ? timeout_ms : config_.timeout_ms;
  const Deadline deadline = Deadline::after_ms(t);
  const std::string me = std::to_string(rank_) + "/" + std::to_string(incarnation_);
  const std::string key = prefix_ + "admitted/" + me, refused = prefix_ + "refused/" + me;
  int64_t sleep_us = 500;
  while (!store_.check(key)) {
    if (store_.check(refused))
      throw_error(ErrorKind::kInvalidArgument, -1,
                  "join_group: the members refused this process: ", store_.get(refused, 1000));
    if (deadline.expired())
      throw_error(ErrorKind::kTimeout, -1, "join_group: not admitted within ", t,
                  " ms (the healthy ranks call recover_ranks with this rank)");
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min<int64_t>(sleep_us * 2, 10000);
  }
  View view = View::decode(store_.get(key, 1000), " under '" + key + "'");
  if (view.capacity() != capacity_ || !view.is_member(rank_) ||
      view.incarnation[rank_] != incarnation_)
    throw_error(ErrorKind::kInternal, -1, "malformed group view under '", key,
                "' in the store: it does not admit rank ", rank_, " incarnation ", incarnation_,
                " into a group of max_world_size=", capacity_);
  std::vector<int> others = view.members();
  connect_new(view, others, deadline);
  op_seq_ = done_seq_ = view.seq;
  joining_ = false;
  apply(view);
}

}  // namespace mooncake
