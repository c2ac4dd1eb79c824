// The c10d::Backend for mooncake-cpu: converts tensors to raw buffers,
// validates arguments, and queues the core's collectives. CPU tensors only;
// the backend for CUDA tensors ("mooncake", cuda_backend.h) derives from it.
//
// The definitions are split by concern: backend.cc (construction, the view
// and elastic membership, the op queue, coalescing), collectives_reduce.cc
// and collectives_exchange.cc (the collectives), p2p_ops.cc (send and recv);
// work.h (the Work it returns) and tensor_args.h (conversions and argument
// checks) serve them all.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <tuple>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/p2p.h"
#include "collectives/request.h"
#include "core/error.h"
#include "torch/work.h"
#include "transport/engine.h"

namespace mooncake {

// pg.MooncakeBackendOptions: upstream's six constructors (bind_backend.cc)
// fill it. Checked here, once.
struct MooncakeBackendOptions : c10d::Backend::Options {
  MooncakeBackendOptions(at::Tensor active_ranks, bool is_extension,
                         std::optional<int64_t> max_world_size,
                         bool auto_deactivate_on_failure = true, bool auto_sync_on_failure = true);
  // The same options for another mask (`active` may be undefined).
  c10::intrusive_ptr<MooncakeBackendOptions> with_mask(at::Tensor active) const;
  at::Tensor active_ranks;  // undefined: the backend makes its own, all active
  bool is_extension = false;
  std::optional<int64_t> max_world_size;  // upstream's max_group_size
  // What an op does when it meets a failed peer (core/comm_config.h): both
  // on: the survivors agree and re-run it (kRecoverRerun); sync off: it
  // fails and the next op settles the view (kRecoverDeferred); deactivate
  // off: it fails and the view waits for the application (kRecoverOff).
  bool auto_deactivate_on_failure = true;
  bool auto_sync_on_failure = true;
};

// pg.ProposeViewUpdateResponse and pg.SyncAfterFailureResponse, with
// upstream's status values.
enum class ProposalStatus { kRejected = 0, kApplied = 1, kAppliedWithDroppedRanks = 2 };
struct ProposalResponse {
  ProposalStatus status = ProposalStatus::kRejected;
  int64_t new_epoch = 0;
  std::vector<int64_t> dropped_ranks;  // left the view beyond what was asked, or not admitted
  std::string reject_reason;
};
enum class SyncStatus { kReconciled = 0, kNoPending = 1, kRejected = 2 };
struct SyncResponse {
  SyncStatus status = SyncStatus::kNoPending;
  std::string reject_reason;
};

// Process-wide defaults for groups created afterwards (pg.set_*_us); < 0: unset.
struct GroupDefaults {
  std::atomic<int64_t> collective_timeout_ms{-1};
  std::atomic<int64_t> p2p_timeout_ms{-1};
  std::atomic<int64_t> report_grace_ms{-1};
};
GroupDefaults& group_defaults();

class MooncakeBackend : public c10d::Backend {
 public:
  MooncakeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout,
                  c10::intrusive_ptr<MooncakeBackendOptions> options,
                  std::shared_ptr<TransferEngine> engine, const char* name = kName);
  ~MooncakeBackend() override;

  static constexpr const char* kName = "mooncake-cpu";
  const std::string getBackendName() const override { return kName; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void setTimeout(std::chrono::milliseconds timeout) override;

  // Collectives: collectives_reduce.cc and collectives_exchange.cc.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Takes this rank's part in the group's next collective without running it:
  // every rank's call of that collective fails with a ValueError that names
  // this rank and gives `reason` (for a layer above that found, on this rank
  // only, that the op must not run: e.g. corrupt data from a peer).
  c10::intrusive_ptr<c10d::Work> reject_next(const std::string& reason);
  // Point to point: p2p_ops.cc.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  void shutdown() override;
  void abort() override { shutdown(); }

  // The spec's pg.* helpers.
  virtual at::Tensor active_ranks() const { return active_ranks_; }
  int num_synced_ranks() const;
  // Changes whenever active_ranks is rewritten: lets a caller keep a copy (on the
  // GPU, say) and refresh it only when the view changed.
  int64_t view_version() const { return view_version_.load(); }
  // Its word, for callers that read it on every call (Python through ctypes:
  // a bound method's call costs microseconds on a slow host).
  const std::atomic<int64_t>* view_version_word() const { return &view_version_; }
  void extend_group_size_to(int64_t size);
  // Collective among the members: whether a process waits to join as each rank.
  std::vector<bool> get_peer_state(const std::vector<int64_t>& ranks);
  // Collective among the members: admits the waiting processes (with
  // `wait`, waits for processes that have not shown up yet).
  ProposalResponse recover_ranks(const std::vector<int64_t>& ranks, bool wait = false);
  // Collective among the members that stay: a view without `ranks`.
  ProposalResponse deactivate_ranks(const std::vector<int64_t>& ranks);
  // Settles a failure an op met (Communicator::sync_after_failure).
  SyncResponse sync_after_failure();
  // The view's epoch, as active_ranks shows it.
  int64_t current_epoch() const;
  // Whether the others left this rank out (they post so into its segment when
  // they agree on a view without it): one load, for a layer that must not act
  // for a rank that is out before its next op on the group tells it (the EP
  // device path looks before every launch).
  bool left_out() const;
  const c10::intrusive_ptr<MooncakeBackendOptions>& options() const { return options_; }
  // (collective op, p2p op, report grace) in ms: what pg.set_*_us gave this group.
  std::tuple<int64_t, int64_t, int64_t> timeouts_ms() const;
  bool joining() const { return comm_ && comm_->joining(); }
  // A process created with is_extension=True: waits until admitted.
  void join_group();
  std::string transport_of(int peer) const;
  const std::shared_ptr<TransferEngine>& engine() const { return engine_; }
  // Calls `fn` as soon as the group's transport sees a peer lost: its process
  // gone, or its heartbeat still past the group's hang limit
  // (Endpoint::watch_peers). For the device, which cannot watch processes.
  uint64_t watch_peers(Endpoint::LossListener fn);

 protected:
  using Task = std::function<void()>;
  // Called (on the op thread, under the view lock) after the view has been
  // copied into active_ranks_.
  virtual void view_changed(const at::Tensor& active) {}
  // Queues `task` on the op queue, in order with the collectives.
  std::shared_ptr<Request> submit(Task task);
  // Queues `task` on the collective thread; `outputs` become the Work's result.
  // `sync`: the caller waits for it at once (async_op=False), so it runs here
  // and now instead (outside a coalescing block).
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, Task task,
                                         std::vector<at::Tensor> outputs, bool sync = false);
  int64_t op_timeout_ms(std::chrono::milliseconds op_timeout) const;
  bool shut_down() const { return shut_down_.load(); }
  Communicator& comm() { return *comm_; }
  Store& store() { return *store_; }
  // The store namespace of this incarnation of the group.
  const std::string& prefix() const { return prefix_; }
  int64_t timeout_ms() const { return timeout_ms_; }
  // The group's point-to-point messages (made on first use).
  P2P& p2p();
  int64_t p2p_timeout_ms() const { return p2p_timeout_ms_ > 0 ? p2p_timeout_ms_ : timeout_ms_; }
  // A Work for `request` (counted in a coalescing block); `queue` is the
  // queue it runs on, if any, so that a waiter can help run it; `failed`,
  // what its task records of failed peers.
  c10::intrusive_ptr<c10d::Work> wrap(std::shared_ptr<Request> request, c10d::OpType type,
                                      std::vector<at::Tensor> outputs,
                                      std::weak_ptr<OpQueue> queue = {},
                                      FailedRanks failed = nullptr);

 private:
  // Builds and queues a collective. When this rank rejects its arguments
  // (ValueError here), it still takes its part in the collective so the
  // other ranks fail at once with an error naming this rank, rather than
  // waiting out their timeout, and the group stays in step.
  template <typename Build>
  c10::intrusive_ptr<c10d::Work> collective(Build&& build) {
    try {
      return build();
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kInvalidArgument && !shut_down_.load() && comm_) {
        std::string reason = e.what();
        queue_->submit([this, reason] { comm_->reject(reason, timeout_ms_); });
      }
      throw;
    }
  }
  // Posts a p2p op and returns the Request it completes.
  using Post = std::function<std::shared_ptr<Request>()>;
  // A send or recv: `check` validates the arguments and returns how to post
  // the op; outside a coalescing block it is posted at once. Inside one it is
  // posted at endCoalescing, with the others, all or none: an argument error
  // is raised by endCoalescing and the batch posts nothing.
  // `send`: the op is a send, whose Work waits through the sends' queue.
  c10::intrusive_ptr<c10d::Work> p2p_op(c10d::OpType type, std::vector<at::Tensor> outputs,
                                        const std::function<Post()>& check, bool send = false);
  // The group's slots (max_world_size): the length of a Work's failed-ranks hint.
  int slots() const { return static_cast<int>(active_ranks_.numel()); }
  // Copies a view into the active_ranks tensor (on the op thread).
  void show_view(const View& view);
  // Runs `task` on the op queue, in order with the collectives, and waits.
  void run_on_queue(const char* what, Task task);

  std::unique_ptr<Store> store_;
  std::string prefix_;
  std::shared_ptr<TransferEngine> engine_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<P2P> p2p_;
  std::mutex p2p_mu_;
  std::shared_ptr<OpQueue> queue_ = std::make_shared<OpQueue>();
  c10::intrusive_ptr<MooncakeBackendOptions> options_;
  at::Tensor active_ranks_;
  mutable std::mutex view_mu_;
  int num_members_ = 0;
  int64_t epoch_ = 0;                     // the shown view's, under view_mu_
  std::atomic<int64_t> view_version_{0};  // bumped whenever show_view writes the view
  int64_t extended_size_ = 0;
  // The width of a per-rank list of `n` entries: the world size, or the size
  // extend_group_size_to admitted (the longer lists also address the ranks
  // that joined past the world size). Anything else is an invalid argument.
  int list_width(size_t n, const char* op, const char* arg) const;
  // The same for a tensor form whose `whole` elements hold one `part` per
  // rank: the extended size when it fits exactly, else the world size (whose
  // check then names what is wrong).
  int parts_width(int64_t whole, int64_t part) const;
  int64_t timeout_ms_;
  int64_t p2p_timeout_ms_;  // pg.set_p2p_timeout_us's when > 0, else timeout_ms_
  bool coalescing_ = false;
  std::vector<std::shared_ptr<Request>> coalesced_;
  std::vector<FailedRanks> coalesced_failed_;
  // Inside a coalescing block (batch_isend_irecv): the p2p ops to post at
  // endCoalescing, each with the Request its Work waits on, and the first
  // argument error, which endCoalescing raises instead (torch's block has
  // been closed by then, so the group stays usable).
  std::vector<std::pair<Post, std::shared_ptr<Request>>> deferred_;
  std::exception_ptr batch_error_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace mooncake
