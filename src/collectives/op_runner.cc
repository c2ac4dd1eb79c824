// OpRunner: an op's lifecycle across failures (see op_runner.h and
// "Failures" in communicator.h; the agreement is membership/agreement.h).
#include "collectives/op_runner.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "core/copy.h"
#include "core/error.h"
#include "core/log.h"
#include "membership/agreement.h"
#include "membership/hints.h"

namespace mooncake {

namespace {

// Re-runs among unchanged members before an op is given up as timed out.
constexpr int kMaxStalledAttempts = 2;

}  // namespace

// (Empty regions are skipped: their pointers may be null, which memcpy
// may not be given even for 0 bytes.)
void HostOpData::save_input(uint8_t* to) const {
  if (inplace_.bytes != 0) std::memcpy(to, inplace_.ptr, inplace_.bytes);
}

void HostOpData::restore_input(const uint8_t* from) {
  if (!as_it_goes_) {
    if (inplace_.bytes != 0) std::memcpy(inplace_.ptr, from, inplace_.bytes);
    return;
  }
  for (const auto& [begin, end] : overwritten_)
    std::memcpy(static_cast<uint8_t*>(inplace_.ptr) + begin, from + begin, end - begin);
  overwritten_.clear();
}

size_t HostOpData::offset_of(const void* p, size_t len) const {
  const auto at = static_cast<size_t>(static_cast<const uint8_t*>(p) -
                                      static_cast<const uint8_t*>(inplace_.ptr));
  MC_ASSERT(p >= inplace_.ptr && at + len <= inplace_.bytes, "kept bytes outside the input");
  return at;
}

void HostOpData::keep(const void* p, size_t len) {
  // Past the cache: the kept bytes are read only after a failure.
  if (keep_ == nullptr || len == 0) return;
  copy_past_cache(keep_ + offset_of(p, len), static_cast<const uint8_t*>(p), len);
}

void HostOpData::overwrite(const void* p, size_t len) {
  if (keep_ == nullptr || len == 0) return;
  const size_t at = offset_of(p, len);
  // Pieces come in order: extend the last range where they touch it.
  if (!overwritten_.empty() && overwritten_.back().second == at)
    overwritten_.back().second = at + len;
  else
    overwritten_.emplace_back(at, at + len);
}

size_t HostOpData::result_bytes() const {
  size_t n = 0;
  for (const Region& r : result_) n += r.bytes;
  return n;
}

void HostOpData::read_result(uint8_t* to) const {
  for (const Region& r : result_) {
    if (r.bytes == 0) continue;
    std::memcpy(to, r.ptr, r.bytes);
    to += r.bytes;
  }
}

void HostOpData::write_result(size_t at, const uint8_t* from, size_t len) {
  for (const Region& r : result_) {
    if (len == 0) return;
    if (at >= r.bytes) {
      at -= r.bytes;
      continue;
    }
    const size_t n = std::min(len, r.bytes - at);
    std::memcpy(static_cast<uint8_t*>(r.ptr) + at, from, n);
    from += n;
    len -= n;
    at = 0;
  }
}

OpRunner::OpRunner(Store& store, std::string prefix, int rank, int size, int capacity,
                   const CommConfig& config, Endpoint& endpoint, Channels& coll, Channels& p2p,
                   bool joining, HeaderRound header_round)
    : store_(store),
      prefix_(std::move(prefix)),
      rank_(rank),
      capacity_(capacity),
      config_(config),
      endpoint_(endpoint),
      coll_(coll),
      p2p_(p2p),
      joining_(joining),
      header_round_(std::move(header_round)) {
  if (joining) {
    view_ = View::initial(1, capacity);  // alone until admitted
    view_.active[0] = 0;
    view_.active[rank] = 1;
    members_ = {rank};
    return;
  }
  view_ = View::initial(size, capacity);
  members_ = view_.members();
  coll_.set_watched(members_, view_.epoch);
}

OpMeta OpRunner::begin(OpType type, DType dtype, RedOp op, int root, uint64_t numel,
                       int64_t timeout_ms, std::string local_error) {
  MC_CHECK_ARG(!joining_, op_name(type),
               ": this process joins a running group (is_extension=True): call "
               "pg.join_group() first");
  int64_t t = timeout_ms >= 0 ? timeout_ms : config_.timeout_ms;
  return OpMeta{type,
                dtype,
                op,
                root,
                numel,
                ++op_seq_,
                t,
                Deadline::after_ms(t),
                op_name(type),
                std::move(local_error)};
}

View OpRunner::view_copy() const {
  std::lock_guard<std::mutex> lock(view_mu_);
  return view_;
}

uint64_t OpRunner::view_epoch() const {
  std::lock_guard<std::mutex> lock(view_mu_);
  return view_.epoch;
}

void OpRunner::set_view_listener(std::function<void(const View&)> listener) {
  on_view_ = std::move(listener);
  shown_epoch_ = view_.epoch;  // the caller shows the current view itself
}

void OpRunner::joined(const View& view) {
  op_seq_ = done_seq_ = view.seq;
  joining_ = false;
  apply(view);
}

void OpRunner::run(OpMeta& meta, Finish finish, OpData& data,
                   const std::function<void()>& attempt) {
  const bool rerun = config_.recover == kRecoverRerun;
  // The input a re-run needs, in a buffer kept across ops (no page faults).
  // Kept in every mode: without re-runs of its own, an op still re-runs when
  // the others call an agreement (sync_after_failure, deactivate_ranks).
  const bool keep_input = data.input_bytes() != 0;
  if (keep_input) {
    if (saved_input_.size() < data.input_bytes()) saved_input_.resize(data.input_bytes());
    if (data.keeps_as_it_goes())
      data.keep_into(saved_input_.data());
    else
      data.save_input(saved_input_.data());
  }
  // Errors that end the op: bad arguments, a dead root, this rank left out
  // (kLeftOut, from the agreement: never peer_or_timeout), shutting down;
  // and, when failures are not re-run, any failure unless the others have
  // called an agreement (which every member takes part in).
  auto final_error = [&](const Error& e) {
    if (!e.peer_or_timeout() || stopping_.load() || e.peer() == rank_ ||
        (meta.root >= 0 && e.peer() == meta.root && !view_.is_member(meta.root)))
      return true;
    return !rerun && !agreement_called(endpoint_, view_.epoch);
  };
  auto fail = [&](const Error& e) {
    note_failure(e);
    finished(meta.seq, nullptr, true);
    show(view_);
  };
  for (int attempt_no = 0;; ++attempt_no) {
    if (attempt_no > 0) {
      if (keep_input) data.restore_input(saved_input_.data());
      meta.deadline = Deadline::after_ms(meta.timeout_ms);
    }
    std::optional<Error> failure;
    attempt_epoch_ = view_.epoch;
    // kRecoverDeferred: a failure an earlier op met is settled before this op
    // runs (it was that op's, so it is not recorded as this one's).
    const bool settle_first = config_.recover == kRecoverDeferred && !pending_.empty();
    if (settle_first) {
      failure = Error(
          ErrorKind::kPeerFailed,
          str(meta.name, ": settling the failure of rank ", pending_[0], " that an earlier op met"),
          pending_[0]);
    } else {
      try {
        check_not_left_behind();  // a recovery started while this rank was away
        if (latched_) {
          for (int p : pending_) add_failed(p);
          const int peer = pending_.empty() ? -1 : pending_[0];
          throw_error(ErrorKind::kPeerFailed, peer, meta.name, ": an earlier op failed on ",
                      peer >= 0 ? str("rank ", peer) : std::string("a failed peer"),
                      " (the group's view is ", view_.describe(),
                      "; failures are left to the application): call pg.sync_after_failure or "
                      "pg.deactivate_ranks first");
        }
        if (meta.root >= 0 && meta.local_error.empty() && !view_.is_member(meta.root)) {
          // Said in step with the others: one exchange of headers, so a member
          // that named a live root gets a mismatch instead of waiting for this
          // rank, and every member's op count stays the same.
          header_round_(meta);
          throw_error(ErrorKind::kPeerFailed, meta.root, meta.name, ": root rank ", meta.root,
                      " has failed; the active ranks are ", view_.describe(),
                      " (no data to return)");
        }
        meta.committed = false;
        attempt();
        if (finish == Finish::kCommit && members_.size() > 1 && !meta.committed)
          header_round_(meta);  // the commit round
        // A recovery called meanwhile does not undo a completed attempt: where
        // the op did not complete, it can (kCommit) or gets this rank's result
        // (kForward), and this rank reports at its next op, as one that
        // completed a moment earlier does. Reporting now could deadlock: a
        // member that completed this op may wait on this rank outside any op
        // (a p2p receive), unable to report, and be left out.
        if (told_left_out(endpoint_, view_.epoch)) check_not_left_behind();
      } catch (const Error& e) {
        // Stale messages from an abandoned attempt can look like a mismatch to
        // a rank that was left out: it learns so first. A peer failure, not
        // kLeftOut: the agreement it leads to decides whether this rank is out.
        if (e.kind() == ErrorKind::kInvalidArgument && agreement_called(endpoint_, view_.epoch)) {
          failure = Error(ErrorKind::kPeerFailed, "the group has moved on without this rank");
        } else if (final_error(e)) {
          fail(e);
          throw;
        } else {
          failure = e;
        }
      }
    }
    bool completed = !failure;
    while (failure) {  // recovering may meet failures of its own
      MC_LOG(kInfo, meta.name, " #", meta.seq, " failed at epoch ", view_.epoch, ": ",
             failure->what());
      try {
        completed = recover(meta, finish, data, *failure, attempt_no, {}, !settle_first);
        failure.reset();
      } catch (const Error& e) {
        if (final_error(e)) {
          fail(e);
          throw;
        }
        failure = e;
      }
    }
    if (!completed) continue;
    finished(meta.seq, finish == Finish::kForward ? &data : nullptr, false);
    show(view_.epoch == attempt_epoch_ ? view_ : attempt_view_);
    return;
  }
}

// A recovery was called at this rank's epoch (or one left it out): a peer
// failure, to recover from; the agreement says whether this rank is left out.
void OpRunner::check_not_left_behind() {
  if (agreement_called(endpoint_, view_.epoch))
    throw_error(ErrorKind::kPeerFailed, -1, "the members of epoch ", view_.epoch,
                " are agreeing on a new view (a member failed)");
}

void OpRunner::finished(uint64_t seq, const OpData* result, bool failed) {
  done_seq_ = seq;
  done_failed_ = failed;
  has_kept_ = result != nullptr;
  if (!has_kept_) return;
  kept_seq_ = seq;
  kept_.resize(result->result_bytes());
  result->read_result(kept_.data());
}

bool OpRunner::recover(const OpMeta& meta, Finish finish, OpData& data, const Error& cause,
                       int attempts, const std::vector<int>& drop, bool record_lost) {
  Report mine;
  mine.rank = rank_;
  mine.pending = meta.seq;
  mine.done = done_seq_;
  mine.has_result = has_kept_ && kept_seq_ == done_seq_;
  mine.failed = done_failed_;
  mine.attempts = attempts;
  auto responsive = [&](int q) { return coll_.peer_problem(q).empty(); };
  const int before = view_.num_members();
  // Members that are not in an op, or wait for one that cannot complete,
  // learn at once that a recovery is on and come to report.
  for (int p : members_)
    if (p != rank_) announce_recovery(endpoint_, p, view_.epoch);
  // Members have until the op's own deadline to show up, the rule the op
  // itself follows, and a short grace beyond it to answer: a rank that never
  // calls the op is left out about one timeout after the op began, not two.
  const Deadline until =
      meta.deadline.latest(Deadline::after_ms(std::min(meta.timeout_ms, config_.report_grace_ms)));
  Decision d;
  try {
    d = agree_on_view(store_, prefix_, view_, mine, responsive, until, drop);
  } catch (const Error& e) {
    // The ranks that reach the store agree without this one: it is out (and
    // retrying would only spin until the store answers again).
    if (!store_unreachable(e)) throw;
    throw_error(ErrorKind::kLeftOut, rank_, "rank ", rank_,
                " lost the store during a recovery, so it cannot take part in the agreement; "
                "the ranks that reach the store go on without it (",
                e.what(),
                "); once the store is reachable it can rejoin as a new process with "
                "is_extension=True");
  }
  if (view_.epoch == attempt_epoch_) attempt_view_ = view_;
  const std::vector<int> was = members_;
  apply(d.view, /*show=*/false);
  // The view has settled every failure met so far: those still in it reported.
  pending_.clear();
  if (record_lost)
    for (int p : was)
      if (!d.view.is_member(p)) add_failed(p);
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
    // It ended in an error where it completed: a rank rejected its arguments,
    // or, when failures are not re-run, met a failed peer.
    finished(meta.seq, nullptr, true);
    if (config_.recover != kRecoverRerun) {
      int lost = -1;  // a rank this agreement left out: the likely cause
      for (int p : was)
        if (lost < 0 && !d.view.is_member(p)) lost = p;
      throw_error(ErrorKind::kPeerFailed, lost, meta.name,
                  ": the op failed on the other ranks (a peer failed) while this rank waited");
    }
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
      receive_result(meta, source, data);
    }
    return true;
  }
  // Ahead: this rank completed c; the first one that kept c's result hands it on.
  if (source == rank_)
    for (const Report& r : d.reports)
      if (r.pending == c) send_result(c, r.rank, Deadline::after_ms(meta.timeout_ms));
  return false;
}

void OpRunner::add_failed(int peer) {
  if (peer < 0 || peer >= capacity_ || peer == rank_) return;
  if (std::find(failed_.begin(), failed_.end(), peer) == failed_.end()) failed_.push_back(peer);
  if (config_.recover != kRecoverRerun && view_.is_member(peer) &&
      std::find(pending_.begin(), pending_.end(), peer) == pending_.end())
    pending_.push_back(peer);
}

void OpRunner::note_failure(const Error& e) {
  if (!e.peer_or_timeout()) return;
  if (config_.recover == kRecoverOff) latched_ = true;
  add_failed(e.peer());
  for (int p : members_)
    if (p != rank_ && !coll_.peer_problem(p).empty()) add_failed(p);
}

ViewChange OpRunner::settle(const char* what, int64_t timeout_ms, const std::vector<int>& drop,
                            bool only_if_called) {
  MC_CHECK_ARG(!joining_, what,
               ": this process joins a running group (is_extension=True): call "
               "pg.join_group() first");
  const int64_t t = timeout_ms >= 0 ? timeout_ms : config_.timeout_ms;
  // Numbered as the next op, which it does not take: the reports then say
  // this rank is between ops, so the agreement has it hand on a result it
  // holds to a member that missed it.
  OpMeta meta{OpType::kBarrier,      DType::kUInt8, RedOp::kSum, -1, 0, op_seq_ + 1, t,
              Deadline::after_ms(t), what,          {}};
  const std::vector<int> before = members_;
  auto needed = [&] {
    if (agreement_called(endpoint_, view_.epoch)) return true;
    if (only_if_called) return false;
    if (!drop.empty())
      return std::any_of(drop.begin(), drop.end(), [&](int q) { return view_.is_member(q); });
    if (!pending_.empty()) return true;
    for (int p : members_)
      if (p != rank_ && !coll_.peer_problem(p).empty()) return true;
    return false;
  };
  ViewChange out;
  HostOpData nothing({}, {});
  while (needed()) {
    if (stopping_.load())
      throw_error(ErrorKind::kPeerFailed, -1, what, ": the process group is shutting down");
    // Each round moves the epoch on; a drop that another round's decision
    // did not take (it was made first) goes into the next one.
    if (out.agreed && meta.deadline.expired())
      throw_error(ErrorKind::kTimeout, -1, what, ": the members did not settle on a view within ",
                  t, " ms");
    recover(meta, Finish::kCommit, nothing, Error(ErrorKind::kPeerFailed, what), 0, drop, false);
    out.agreed = true;
  }
  out.settled = out.agreed || latched_;
  latched_ = false;
  show(view_);
  out.epoch = view_.epoch;
  for (int p : before)
    if (!view_.is_member(p)) out.lost.push_back(p);
  return out;
}

void OpRunner::send_result(uint64_t seq, int to, const Deadline& deadline) {
  const size_t chunk = coll_.layout().chunk_bytes;
  MsgHeader h{};
  h.op_seq = seq;
  h.op_type = static_cast<uint32_t>(OpType::kForward);
  h.numel = kept_.size();
  size_t at = 0;
  do {
    const size_t len = std::min(chunk, kept_.size() - at);
    coll_.send(to, h, kept_.data() + at, len, deadline, "recovery");
    at += len;
  } while (at < kept_.size());
}

void OpRunner::receive_result(const OpMeta& meta, int from, OpData& data) {
  const size_t total = data.result_bytes();
  size_t at = 0;
  do {
    const MsgHeader* msg = coll_.receive(from, meta.deadline, meta.name);
    MC_ASSERT(msg->op_type == static_cast<uint32_t>(OpType::kForward) && msg->op_seq == meta.seq &&
                  msg->numel == total,
              meta.name, ": rank ", from, " handed on a result of op #", msg->op_seq, " (",
              msg->numel, " bytes), expected #", meta.seq, " (", total, " bytes)");
    MC_ASSERT(at + msg->len <= total, meta.name, ": rank ", from, " handed on too many bytes");
    data.write_result(at, reinterpret_cast<const uint8_t*>(msg + 1), msg->len);
    at += msg->len;
    coll_.release(from, meta.deadline);
  } while (at < total);
}

void OpRunner::show(const View& view) {
  if (!on_view_ || view.epoch == shown_epoch_) return;
  shown_epoch_ = view.epoch;
  on_view_(view);
}

void OpRunner::apply(const View& view, bool show_it) {
  const std::vector<int> before = members_;
  {
    std::lock_guard<std::mutex> lock(view_mu_);
    view_ = view;
    members_ = view.members();
  }
  for (int p : before) {
    if (view.is_member(p)) continue;
    announce_left_out(endpoint_, p, view.epoch);  // it learns so, if it lives
    endpoint_.disconnect(p);
  }
  for (int p : members_) coll_.restart(p, view.collective_gen(rank_, p), view.incarnation[p]);
  coll_.set_watched(members_, view.epoch);
  if (show_it) show(view);
}

void OpRunner::connect_new(const View& view, const std::vector<int>& slots,
                           const Deadline& deadline) {
  for (int q : slots) {
    if (q == rank_ || !view.is_member(q)) continue;
    try {
      endpoint_.connect(q, view.incarnation[q], deadline);
    } catch (const Error& e) {
      MC_LOG(kWarn, "membership: cannot connect to rank ", q, ": ", e.what());
      endpoint_.disconnect(q);
    }
    p2p_.restart(q, view.p2p_gen(rank_, q), view.incarnation[q]);
  }
}

}  // namespace mooncake
