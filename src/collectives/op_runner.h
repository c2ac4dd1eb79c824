// An op's lifecycle among the group's current members, apart from how its
// bytes move: numbering ops, running an attempt, and after a failure the
// agreement on the next view, re-runs and the hand-on of results ("Failures"
// in communicator.h). The data plane that moves the bytes (host memory over
// the message channels: Communicator) gives each op an attempt to run and an
// OpData saying how to keep its input and result; a device plane can give its
// own, so the failure rules are written once for both.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "collectives/channel.h"
#include "core/clock.h"
#include "core/comm_config.h"
#include "core/dtype.h"
#include "core/error.h"
#include "membership/view.h"
#include "store/store.h"
#include "transport/engine.h"

namespace mooncake {

enum class OpType : uint32_t {
  kBarrier = 1,
  kAllReduce,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kReduce,
  kGather,
  kScatter,
  kAdmit,    // members take in new processes (recover_ranks)
  kForward,  // a completed op's result, handed to a survivor that missed it
};
const char* op_name(OpType t);

struct OpMeta {
  OpType type;
  DType dtype;
  RedOp redop;
  int root;
  uint64_t numel;
  uint64_t seq;
  int64_t timeout_ms;
  Deadline deadline;  // of the current attempt
  const char* name;
  std::string local_error;  // this rank rejected its own arguments
  // Set by an attempt whose last round already told every member that every
  // member has all of its data: the kCommit round would repeat it.
  bool committed = false;
};

// How an op completes (see "Failures" in communicator.h).
enum class Finish { kForward, kCommit };

// What the lifecycle keeps of an op's data, wherever the data lives: the
// input an in-place op overwrites (restored before a re-run) and, for a
// kForward op, its result (kept after it completes, and written into a
// survivor that missed it). Both as byte strings in host memory.
class OpData {
 public:
  virtual ~OpData() = default;
  virtual size_t input_bytes() const = 0;  // 0: nothing to keep
  // Whether the attempt itself keeps the input as it goes (HostOpData::keep):
  // the lifecycle then only hands it the buffer (keep_into) instead of
  // saving the whole input before the first attempt.
  virtual bool keeps_as_it_goes() const { return false; }
  virtual void keep_into(uint8_t* /*to*/) {}
  virtual void save_input(uint8_t* to) const = 0;
  virtual void restore_input(const uint8_t* from) = 0;
  virtual size_t result_bytes() const = 0;
  virtual void read_result(uint8_t* to) const = 0;
  // Bytes [at, at + len) of the result, handed on by a rank that completed it.
  virtual void write_result(size_t at, const uint8_t* from, size_t len) = 0;
};

struct Region {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// An op's data in host memory: the result's parts in order, and the in-place input.
class HostOpData final : public OpData {
 public:
  HostOpData(std::vector<Region> result, Region inplace)
      : result_(std::move(result)), inplace_(inplace) {}
  size_t input_bytes() const override { return inplace_.bytes; }
  // Keeping as it goes (large in-place all_reduce): a separate copy of the
  // whole input before the op cost 40-45% of a 16-64 MiB all_reduce on a
  // 2-core VM. Instead the attempt copies each piece into the kept buffer
  // while the piece is in cache (as it sends it, or just before it
  // overwrites it), and says which bytes it overwrote; a re-run restores
  // only those, the rest being the input still. Bytes must be kept before
  // they are overwritten.
  void keep_as_it_goes() { as_it_goes_ = true; }
  bool keeps_as_it_goes() const override { return as_it_goes_; }
  void keep_into(uint8_t* to) override { keep_ = to; }
  // Copies [p, p + len) of the in-place input into the kept buffer (nothing
  // when no buffer was given: the op keeps nothing).
  void keep(const void* p, size_t len);
  // [p, p + len) of the in-place input is (about to be) overwritten.
  void overwrite(const void* p, size_t len);
  void save_input(uint8_t* to) const override;
  void restore_input(const uint8_t* from) override;
  size_t result_bytes() const override;
  void read_result(uint8_t* to) const override;
  void write_result(size_t at, const uint8_t* from, size_t len) override;

 private:
  size_t offset_of(const void* p, size_t len) const;

  std::vector<Region> result_;
  Region inplace_;
  bool as_it_goes_ = false;
  uint8_t* keep_ = nullptr;
  std::vector<std::pair<size_t, size_t>> overwritten_;  // [begin, end) byte ranges
};

// What a membership change outside an op did (OpRunner::settle).
struct ViewChange {
  uint64_t epoch = 0;     // the view's epoch afterwards
  std::vector<int> lost;  // members before that are not members afterwards
  bool agreed = false;    // the members agreed on a new view
  // That, or a failure an op of this rank met (kRecoverOff) is now settled.
  bool settled = false;
  std::string rejected;  // not tried, and why (deactivate_ranks of inactive ranks)
};

class OpRunner {
 public:
  // An exchange of op headers only, among the current members (the data
  // plane's, over the control channels): the commit round, and the step a
  // rooted op takes in step with the others when its root is gone.
  using HeaderRound = std::function<void(const OpMeta&)>;

  // `joining`: a new process for an inactive slot, alone until admitted.
  OpRunner(Store& store, std::string prefix, int rank, int size, int capacity,
           const CommConfig& config, Endpoint& endpoint, Channels& coll, Channels& p2p,
           bool joining, HeaderRound header_round);

  // Numbers a new op (checks that this process may run ops). A non-empty
  // `local_error` means this rank rejected its arguments: the op then only
  // tells the others and throws that error.
  OpMeta begin(OpType type, DType dtype, RedOp op, int root, uint64_t numel, int64_t timeout_ms,
               std::string local_error = {});
  // Runs `attempt` until it succeeds among the members of the current view,
  // recovering from failures in between.
  void run(OpMeta& meta, Finish finish, OpData& data, const std::function<void()>& attempt);

  // The current view and its members (the op thread's; view_copy for others).
  const View& view() const { return view_; }
  const std::vector<int>& members() const { return members_; }
  View view_copy() const;
  // The current view's epoch (without copying its tables: per-op callers).
  uint64_t view_epoch() const;
  // Makes `view` current: drops links to ranks it leaves out, restarts the
  // channels to its members, shows it to the listener (`show`; a recovery
  // inside an op leaves that to the op's end, see shown()).
  void apply(const View& view, bool show_it = true);
  // Connects to the processes of `slots` that `view` names (errors are left
  // for the ops to find, so every member applies the same view).
  void connect_new(const View& view, const std::vector<int>& slots, const Deadline& deadline);
  // The listener sees the view that the op which just ended covered: after a
  // blocking op, the active mask is the set its result is over, even where a
  // recovery during the op moved the group on (the next op shows that). The
  // caller shows the current view itself when it sets the listener.
  void set_view_listener(std::function<void(const View&)> listener);
  bool joining() const { return joining_; }
  // After admission: a member from op `seq` on.
  void joined(const View& view);
  // Wakes blocked waits and makes them fail: the group is going away.
  void stop() { stopping_.store(true); }

  // Membership changes outside any op, in order with the ops. With `drop`
  // empty (sync_after_failure): when this rank holds a failure no view has
  // settled yet (kRecoverOff, kRecoverDeferred), a member is failed, or the
  // others called an agreement, the members agree on a view without the
  // failed ones; otherwise nothing happens. With `drop` (deactivate_ranks,
  // called by the members that stay): they agree on a view without `drop`.
  // `only_if_called`: only take part in an agreement the others called.
  ViewChange settle(const char* what, int64_t timeout_ms, const std::vector<int>& drop,
                    bool only_if_called = false);
  // The ranks the ops since the last call found failed (left out by an
  // agreement, or named by an op's failure), in the order found.
  std::vector<int> take_failed() { return std::exchange(failed_, {}); }

 private:
  // After a failed attempt: agreement, the new view, and handing on results.
  // True when the op is complete without a re-run.
  // `attempts`: re-runs of this op so far. `drop`: see agree_on_view.
  // `record_lost`: the members the agreement leaves out failed in this op.
  bool recover(const OpMeta& meta, Finish finish, OpData& data, const Error& cause, int attempts,
               const std::vector<int>& drop = {}, bool record_lost = true);
  // An op failed for good with `e`: its failed peers go to failed_ and, when
  // failures are not re-run, to pending_ (and kRecoverOff latches).
  void note_failure(const Error& e);
  void add_failed(int peer);
  // Throws a recoverable error when a recovery was called at this rank's epoch.
  void check_not_left_behind();
  // Records op `seq` as done: with its result kept (kForward), or failed.
  void finished(uint64_t seq, const OpData* result, bool failed);
  void send_result(uint64_t seq, int to, const Deadline& deadline);
  // Tells the listener about `view` unless it was the last one shown.
  void show(const View& view);
  void receive_result(const OpMeta& meta, int from, OpData& data);

  Store& store_;
  const std::string prefix_;
  const int rank_;
  const int capacity_;
  const CommConfig& config_;
  Endpoint& endpoint_;
  Channels& coll_;
  Channels& p2p_;
  bool joining_;
  HeaderRound header_round_;
  uint64_t op_seq_ = 0;

  // Membership, owned by the op thread; view_ is also read by others.
  mutable std::mutex view_mu_;
  View view_;
  std::vector<int> members_;  // view_.members()
  std::function<void(const View&)> on_view_;
  uint64_t shown_epoch_ = UINT64_MAX;  // epochs name views: one per agreement
  // The view the current attempt began in, once a recovery has moved view_ on
  // (a result completed elsewhere, or handed on, covers that one).
  uint64_t attempt_epoch_ = 0;
  View attempt_view_;
  std::atomic<bool> stopping_{false};
  // The last completed op, and its result when it finished kForward.
  uint64_t done_seq_ = 0;
  bool done_failed_ = false;
  uint64_t kept_seq_ = 0;
  bool has_kept_ = false;
  std::vector<uint8_t> kept_;
  std::vector<uint8_t> saved_input_;  // the input of an in-place op, for a re-run
  // Failed members an op met that no agreement has settled yet (kRecoverOff,
  // kRecoverDeferred), and what take_failed returns.
  std::vector<int> pending_;
  std::vector<int> failed_;
  // kRecoverOff: an op of this rank failed on a failed peer, so its ops fail
  // at once until the application calls settle() (sync_after_failure,
  // deactivate_ranks). Per rank, so that every rank that saw the op fail
  // fails the same later calls, also one whose view the others settled.
  bool latched_ = false;
};

}  // namespace mooncake
