// Collective algorithms over the message channels, on raw CPU buffers, among
// the members of the group's current view: the host data plane. Each op's
// lifecycle (numbering, re-runs after failures, the hand-on of results) is
// OpRunner's (op_runner.h), which this class drives.
//
// Two shapes of exchange serve every op:
//  * exchange(): each member sends an arbitrary byte range to each peer and
//    receives one from each (all_gather, all_to_all, gather, scatter,
//    broadcast, barrier);
//  * reduce_exchange(): each member sends each peer its contribution to that
//    peer's shard; the owner reduces all contributions in rank order.
// Both are pipelined in chunks through the channels, so tensors of any size
// pass through fixed slots. Small all_reduce/broadcast go direct (one hop);
// large ones use reduce-scatter + all-gather (scatter + all-gather for
// broadcast), so a rank moves O(size), not O(world * size).
//
// The first message of every op on every edge carries the op's metadata;
// all ranks check it before moving data, so mismatched calls (different
// sizes, dtypes, ops, roots) raise an invalid-argument error on every rank
// and leave the channels in step for the next op.
//
// Failures (docs/failures.md says what callers see). An op that sees a member
// die (or hang, or time out) abandons its attempt; the survivors agree on the
// next view through the store (membership/agreement.h), the epoch goes up,
// every channel restarts, and the op runs again among the survivors from its
// kept inputs. So that every survivor returns a result over the same set of
// ranks, an op completes in one of two ways:
//  * kForward (small all_reduce, broadcast, all_gather, barrier: every rank
//    ends with the same result; and a small reduce_scatter, run as an
//    all_reduce of its whole input): the result is kept after the op; if a
//    rank completed it and another did not, the one that did hands its
//    result on.
//  * kCommit (everything else): after the data, a round of empty messages;
//    a rank completes only when every member has all of its data, so if one
//    completed, every survivor can. (An all_to_all of one step already ends
//    with such a round, its verdicts on the split sizes: that one serves.)
// An op that cannot complete raises: kPeerFailed naming the root of a rooted
// op whose root failed, or the failed peer when failures are not re-run
// (CommConfig::recover: then the application settles the view with
// sync_after_failure or deactivate, or the next op does); kLeftOut on a rank
// that the others left out (the agreement's decision); kTimeout when re-runs
// among the same members do not complete in the op's timeout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/channel.h"
#include "collectives/op_runner.h"
#include "core/dtype.h"
#include "core/error.h"
#include "membership/view.h"
#include "store/store.h"
#include "transport/engine.h"

namespace mooncake {

class Communicator {
 public:
  // This process holds slot `rank` of a group of `capacity` slots (0: `size`)
  // whose slots [0, size) start active. With `joining`, the group is already
  // running and this is a new process for an inactive slot: it publishes
  // itself and waits in join() until the members admit it.
  Communicator(const TransferEngine& engine, Store& store, const std::string& prefix, int rank,
               int size, const CommConfig& config, int capacity = 0, bool joining = false);
  ~Communicator();

  int rank() const { return rank_; }
  // The world size the group was created with: per-rank arrays have this many entries.
  int size() const { return size_; }
  int capacity() const { return capacity_; }
  const CommConfig& config() const { return config_; }
  const char* transport_of(int peer) const { return endpoint_->transport_of(peer); }
  Endpoint& endpoint() { return *endpoint_; }
  Channels& p2p_channels() { return *p2p_; }
  Channels& collective_channels() { return *coll_; }
  // The current view (a copy: it changes on the op thread).
  View view() const { return runner_->view_copy(); }
  uint64_t epoch() const { return runner_->view_epoch(); }
  // Called on the op thread after every membership change.
  void set_view_listener(std::function<void(const View&)> listener) {
    runner_->set_view_listener(std::move(listener));
  }
  // Wakes blocked waits and makes them fail: the group is going away.
  void stop();

  // Every op blocks until done. timeout_ms < 0: the configured default.
  // Per-rank arrays (ins/outs/counts) have `width` entries (0: size()),
  // indexed by rank, so that ranks that joined past the world size can be
  // addressed; a member at or past `width` makes the op fail on this rank. The
  // entries of ranks outside the view are ignored (inputs) or zero-filled
  // (outputs). A root may be any slot below the capacity.
  void all_reduce(void* data, size_t count, DType dtype, RedOp op, int64_t timeout_ms = -1);
  void reduce(void* data, size_t count, DType dtype, RedOp op, int root, int64_t timeout_ms = -1);
  void broadcast(void* data, size_t count, DType dtype, int root, int64_t timeout_ms = -1);
  // outs[p] receives rank p's `count` elements.
  void all_gather(const void* in, size_t count, DType dtype, void* const* outs,
                  int64_t timeout_ms = -1, int width = 0);
  // ins[p] is this rank's contribution to rank p's shard of `count` elements.
  void reduce_scatter(const void* const* ins, void* out, size_t count, DType dtype, RedOp op,
                      int64_t timeout_ms = -1, int width = 0);
  // ins[p]/in_counts[p] go to rank p; outs[p]/out_counts[p] come from rank p.
  void all_to_all(const void* const* ins, const size_t* in_counts, void* const* outs,
                  const size_t* out_counts, DType dtype, int64_t timeout_ms = -1, int width = 0);
  // outs (root only) receives every rank's `count` elements.
  void gather(const void* in, size_t count, DType dtype, void* const* outs, int root,
              int64_t timeout_ms = -1, int width = 0);
  // ins (root only) holds each rank's `count` elements.
  void scatter(const void* const* ins, void* out, size_t count, DType dtype, int root,
               int64_t timeout_ms = -1, int width = 0);
  void barrier(int64_t timeout_ms = -1);
  // Takes this rank's part in the next collective without running it: every
  // rank's call of it fails with an invalid-argument error that names this
  // rank, and the group stays in step. For arguments that the layer above
  // rejected on this rank only.
  void reject(const std::string& reason, int64_t timeout_ms = -1);

  // An op whose bytes move outside this class (the CUDA backend's device
  // plane, through peers' mapped device memory), numbered and run like the
  // others and completing kCommit (see "Failures"). Each attempt calls
  // `attempt(members, sync)` with the view's members. The attempt must leave
  // its inputs as they were, for a re-run.
  struct ExternalSync {
    // Returns once every member has called it (a round of headers: calls
    // that disagree on type, dtype, op, root or count raise an
    // invalid-argument error on every rank).
    std::function<void()> barrier;
    // The same, where each edge also carries its byte counts (per slot: what
    // this rank sends to and expects from each), checked at both ends: sizes
    // that disagree on any edge raise an invalid-argument error on every
    // rank. Returns the largest `value` any member passed.
    std::function<uint64_t(const std::vector<size_t>& send_bytes,
                           const std::vector<size_t>& recv_bytes, uint64_t value)>
        sized;
  };
  using ExternalAttempt =
      std::function<void(const std::vector<int>& members, const ExternalSync& sync)>;
  void run_external(OpType type, DType dtype, RedOp op, int root, uint64_t numel,
                    int64_t timeout_ms, const ExternalAttempt& attempt);

  // --- elastic membership (members' side) ---
  // For each slot, whether a new process has published itself for it and
  // waits to be admitted. Collective among the members: all get the same answer.
  std::vector<uint8_t> peer_state(const std::vector<int>& slots, int64_t timeout_ms = -1);
  // Admits the processes waiting for `slots` (inactive slots whose
  // peer_state is true): collective among the members; afterwards they are
  // members too. With `wait`, a process not yet waiting is waited for (up to
  // the timeout) instead of being an error.
  // `limit`: slots at or past it (and below the capacity) are refused, as not
  // yet extended to (-1: none are); checked inside the collective, so members
  // that disagree on it all fail alike.
  void admit(const std::vector<int>& slots, int64_t timeout_ms = -1, bool wait = false,
             int limit = -1);
  // --- joining process's side ---
  bool joining() const { return runner_->joining(); }
  // Blocks until the members admit this process, then connects to them.
  void join(int64_t timeout_ms = -1);

  // --- membership changes the application asks for, in order with the ops ---
  // When this rank holds a failure no view has settled yet (failures not
  // re-run), a member has failed, or the others called an agreement: the
  // members agree on a view without the failed ones (settled = true; also
  // when an op of this rank failed and the others settled the view since).
  // Otherwise nothing happens.
  ViewChange sync_after_failure(int64_t timeout_ms = -1);
  // Collective among the members that stay: they agree on a view without
  // `slots` (dead or alive; a live one gets kLeftOut from its next op).
  // Slots that are not members: nothing happens (rejected says why).
  ViewChange deactivate(const std::vector<int>& slots, int64_t timeout_ms = -1);
  // The ranks the ops since the last call found failed (OpRunner::take_failed).
  std::vector<int> take_failed() { return runner_->take_failed(); }

 private:
  // What one rank sends to and receives from each slot in an exchange.
  struct Plan {
    explicit Plan(int n)
        : send(static_cast<size_t>(n), nullptr),
          recv(static_cast<size_t>(n), nullptr),
          send_bytes(static_cast<size_t>(n), 0),
          recv_bytes(static_cast<size_t>(n), 0) {}
    std::vector<const void*> send;
    std::vector<void*> recv;
    std::vector<size_t> send_bytes;
    std::vector<size_t> recv_bytes;
  };
  // The incarnation of the process waiting to join as `slot` (-1: none), and
  // the capacity (max_world_size) it was created with.
  int64_t waiting_incarnation(int slot, int64_t* capacity = nullptr);
  // While this process waits to be admitted: whether a process that could
  // admit it may still run (the latest process of another slot; one on
  // another host counts, as its end cannot be seen from here).
  bool admitter_may_run();

  // The runner's header-only round: an exchange of an empty plan.
  OpRunner::HeaderRound header_round();
  MsgHeader header(const OpMeta& meta) const;
  // Step 0 of an op this rank rejected: the header, flagged, carries the error.
  void send_rejection(const OpMeta& meta, const MsgHeader& h, int peer);
  // `headers_only`: the plan's sizes travel in the headers (and are checked)
  // but no bytes move. `value`: with agree_on_sizes, becomes the largest any
  // member passed. Returns whether its last round, the verdicts on the sizes,
  // came after every member had all of its data (every member took one
  // step): a commit round.
  bool exchange(const OpMeta& meta, const Plan& plan, bool agree_on_sizes,
                bool headers_only = false, uint64_t* value = nullptr);
  // The round of verdicts: each member's error flag, `value` and `steps`
  // (its step count) go to all; both become the largest any member passed.
  void agree(const OpMeta& meta, const MsgHeader& h, std::string& error, uint64_t* value,
             size_t& steps);
  // With `keep`, the input's pieces are kept as they are sent, and `out`'s
  // before they are overwritten (HostOpData::keep): `out` and every source
  // then lie in keep's in-place input.
  void reduce_exchange(const OpMeta& meta, const void* const* shard_src, const size_t* shard_counts,
                       void* out, HostOpData* keep = nullptr);
  std::string root_error(int root, const char* what) const;
  // A member beyond the per-rank arrays of `width` entries (after an extension
  // past them).
  std::string width_error(const char* what, int width) const;
  // The per-rank arrays' width of a call (0: the world size).
  int width_of(int width) const { return width > 0 ? width : size_; }
  std::string redop_error(RedOp op, DType dtype, const char* what) const;
  std::string validate(const OpMeta& meta, const MsgHeader& h, int peer, size_t expect_recv,
                       size_t expect_send) const;
  // Splits `count` over the members; per-slot offsets and counts (0 for others).
  void even_shards(size_t count, std::vector<size_t>& offsets, std::vector<size_t>& counts) const;
  // Whether an op of `count` elements goes direct (one hop) rather than sharded.
  bool direct(size_t count, DType dtype) const;
  void zero_others(void* const* outs, size_t bytes, int width) const;
  void zero_others(void* const* outs, const size_t* counts, size_t esize, int width) const;

  const int rank_;
  const int size_;
  const int capacity_;
  CommConfig config_;
  Store& store_;
  const std::string prefix_;
  uint32_t incarnation_ = 0;
  std::unique_ptr<Endpoint> endpoint_;
  std::unique_ptr<Channels> coll_;
  std::unique_ptr<Channels> p2p_;
  // The ops' lifecycle and the group's membership; this class moves the bytes.
  std::unique_ptr<OpRunner> runner_;
};

// Bytes a group segment needs for `capacity` ranks with `chunk_bytes` slots.
Layout make_layout(int capacity, size_t chunk_bytes);

}  // namespace mooncake
