// The Communicator's membership ops: admitting new processes into the group
// (recover_ranks), joining one as such a process, and the changes the
// application asks for (sync_after_failure, deactivate_ranks). Running ops
// across failures is OpRunner's (op_runner.h).
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "collectives/communicator.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/record.h"

namespace mooncake {

int64_t Communicator::waiting_incarnation(int slot, int64_t* capacity) {
  const std::string key = prefix_ + "waiting/" + std::to_string(slot);
  if (!store_.check(key)) return -1;
  RecordReader in(store_.get(key, 1000), "joiner record under '" + key + "'");
  const int64_t inc = in.number<uint32_t>("incarnation");
  const int64_t cap = in.number<int>("max_world_size", 1, kMaxCapacity);
  in.end();
  if (capacity != nullptr) *capacity = cap;
  return inc > runner_->view().incarnation[slot] ? inc : -1;
}

std::vector<uint8_t> Communicator::peer_state(const std::vector<int>& slots, int64_t timeout_ms) {
  std::vector<uint8_t> ready(slots.size(), 0);
  for (size_t i = 0; i < slots.size(); ++i) {
    const int q = slots[i];
    MC_CHECK_ARG(q >= 0 && q < capacity_, "get_peer_state: ranks must be in [0, ",
                 "max_world_size=", capacity_, "), got ", q);
    ready[i] = !runner_->view().is_member(q) && waiting_incarnation(q) >= 0;
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
    else if (runner_->view().is_member(q))
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
  OpMeta meta =
      runner_->begin(OpType::kAdmit, DType::kUInt8, RedOp::kSum, -1, digest, timeout_ms, error);
  HostOpData op_data({}, {});
  runner_->run(meta, Finish::kCommit, op_data, [&] { exchange(meta, Plan(capacity_), false); });
  View next = runner_->view();
  next.epoch += 1;
  next.seq = meta.seq;
  for (size_t i = 0; i < slots.size(); ++i) {
    next.active[slots[i]] = 1;
    next.incarnation[slots[i]] = incs[i];
    next.since[slots[i]] = next.epoch;
  }
  // A newcomer listens before it says it waits: one that cannot be reached
  // within a second is gone, which the barrier below finds out.
  runner_->connect_new(next, slots, Deadline::after_ms(std::min<int64_t>(meta.timeout_ms, 1000)));
  for (size_t i = 0; i < slots.size(); ++i)
    store_.set(prefix_ + "admitted/" + std::to_string(slots[i]) + "/" + std::to_string(incs[i]),
               next.encode());
  runner_->apply(next);
  // The first op of the new view, which the newcomers take in join(): a
  // newcomer that died meanwhile is left out here, before admit returns,
  // rather than by the caller's next op.
  barrier(timeout_ms);
}

bool Communicator::admitter_may_run() {
  for (int r = 0; r < capacity_; ++r) {
    if (r == rank_) continue;
    const std::string counter = prefix_ + "slot/" + std::to_string(r) + "/inc";
    const int64_t inc = store_.check(counter) ? store_.add(counter, 0) : 0;
    const std::string key = address_key(prefix_, r, static_cast<uint32_t>(inc));
    if (!store_.check(key)) continue;  // never started (or died before it said where)
    const PeerAddress a = PeerAddress::decode(store_.get(key, 1000), " under '" + key + "'");
    // One on another host, or in another pid namespace, cannot be seen from here.
    if (a.host_key != local_host_key() || a.pid <= 0) return true;
    if (::kill(a.pid, 0) == 0 || errno == EPERM) return true;
  }
  return false;
}

void Communicator::join(int64_t timeout_ms) {
  MC_CHECK_ARG(runner_->joining(),
               "join_group: this process is already a member (join_group is for "
               "processes created with is_extension=True)");
  const int64_t t = timeout_ms >= 0 ? timeout_ms : config_.timeout_ms;
  const Deadline deadline = Deadline::after_ms(t);
  const std::string me = std::to_string(rank_) + "/" + std::to_string(incarnation_);
  const std::string key = prefix_ + "admitted/" + me, refused = prefix_ + "refused/" + me;
  int64_t sleep_us = 500;
  // Whether anyone could still admit this process is looked at every
  // kProbeMs; twice "no" in a row ends the wait (a member may be between
  // processes: its replacement publishes itself within milliseconds).
  constexpr int64_t kProbeMs = 500;
  Deadline probe = Deadline::after_ms(kProbeMs);
  int nobody = 0;
  while (!store_.check(key)) {
    if (store_.check(refused))
      throw_error(ErrorKind::kInvalidArgument, -1,
                  "join_group: the members refused this process: ", store_.get(refused, 1000));
    if (probe.expired()) {
      nobody = admitter_may_run() ? 0 : nobody + 1;
      if (nobody >= 2 && !store_.check(key))
        throw_error(ErrorKind::kPeerFailed, -1,
                    "join_group: no process of this group runs any more (every rank's latest "
                    "process on this host has exited), so none can admit this one: start a "
                    "new group instead of joining this one");
      probe = Deadline::after_ms(kProbeMs);
    }
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
  runner_->connect_new(view, others, deadline);
  runner_->joined(view);
  barrier(timeout_ms);  // the members' last step of admit()
}

ViewChange Communicator::sync_after_failure(int64_t timeout_ms) {
  return runner_->settle("sync_after_failure", timeout_ms, {});
}

ViewChange Communicator::deactivate(const std::vector<int>& slots, int64_t timeout_ms) {
  MC_CHECK_ARG(!slots.empty(), "deactivate_ranks: ranks is empty");
  for (int q : slots) {
    MC_CHECK_ARG(q >= 0 && q < capacity_,
                 "deactivate_ranks: ranks must be in [0, max_world_size=", capacity_, "), got ", q);
    MC_CHECK_ARG(std::count(slots.begin(), slots.end(), q) == 1, "deactivate_ranks: rank ", q,
                 " is named twice");
    MC_CHECK_ARG(q != rank_, "deactivate_ranks: rank ", q,
                 " is this rank: the ranks that stay call it, naming the others");
  }
  // First an agreement the others called (likely their deactivate_ranks of
  // the same ranks, which this one joins with its own): the ranks are judged
  // against the view that every member holds afterwards.
  ViewChange change = runner_->settle("deactivate_ranks", timeout_ms, slots, true);
  auto members_among = [&] {
    return std::any_of(slots.begin(), slots.end(),
                       [&](int q) { return runner_->view().is_member(q); });
  };
  if (change.agreed && !members_among()) return change;
  std::string inactive;
  for (int q : slots)
    if (!change.agreed && !runner_->view().is_member(q))
      inactive += (inactive.empty() ? "" : ", ") + str(q);
  if (!inactive.empty()) {
    change.rejected = str("deactivate_ranks: ranks [", inactive,
                          "] are not active; the active ranks are ", runner_->view().describe());
    return change;
  }
  return runner_->settle("deactivate_ranks", timeout_ms, slots);
}

}  // namespace mooncake
