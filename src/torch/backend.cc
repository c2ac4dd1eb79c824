#include "torch/backend.h"

#include <algorithm>

#include "core/env.h"
#include "core/error.h"
#include "membership/hints.h"
#include "store/store.h"
#include "torch/c10d_store.h"
#include "torch/tensor_args.h"
#include "torch/work.h"

namespace mooncake {

// --- options --------------------------------------------------------------------------

MooncakeBackendOptions::MooncakeBackendOptions(at::Tensor active, bool extension,
                                               std::optional<int64_t> max_world,
                                               bool auto_deactivate, bool auto_sync)
    : Options("mooncake"),
      active_ranks(std::move(active)),
      is_extension(extension),
      max_world_size(max_world),
      auto_deactivate_on_failure(auto_deactivate),
      auto_sync_on_failure(auto_sync) {
  if (active_ranks.defined()) {
    MC_CHECK_ARG(active_ranks.scalar_type() == at::kInt,
                 "MooncakeBackendOptions: active_ranks must be a torch.int32 tensor, got ",
                 dtype_str(active_ranks.scalar_type()));
    MC_CHECK_ARG(active_ranks.dim() == 1, "MooncakeBackendOptions: active_ranks must be 1-D, got ",
                 active_ranks.dim(), " dims");
  }
  if (max_world_size.has_value())
    MC_CHECK_ARG(*max_world_size >= 1,
                 "MooncakeBackendOptions: max_group_size (max_world_size) must be >= 1, got ",
                 *max_world_size);
  MC_CHECK_ARG(auto_deactivate_on_failure || !auto_sync_on_failure,
               "MooncakeBackendOptions: auto_sync_on_failure=True requires "
               "auto_deactivate_on_failure=True (pass auto_sync_on_failure=False too)");
}

c10::intrusive_ptr<MooncakeBackendOptions> MooncakeBackendOptions::with_mask(
    at::Tensor active) const {
  auto copy =
      c10::make_intrusive<MooncakeBackendOptions>(std::move(active), is_extension, max_world_size,
                                                  auto_deactivate_on_failure, auto_sync_on_failure);
  copy->timeout = timeout;
  return copy;
}

GroupDefaults& group_defaults() {
  static GroupDefaults defaults;
  return defaults;
}

namespace {

// Options for a group created without pg_options: as upstream, the failure
// handling comes from the environment.
c10::intrusive_ptr<MooncakeBackendOptions> options_from_env() {
  const int64_t deactivate = env_int("MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE");
  MC_CHECK_ARG(deactivate == 0 || deactivate == 1,
               "MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE must be 0 or 1, got ", deactivate);
  // Unset: as MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE.
  const int64_t sync = env_string("MOONCAKE_PG_AUTO_SYNC_ON_FAILURE").empty()
                           ? deactivate
                           : env_int("MOONCAKE_PG_AUTO_SYNC_ON_FAILURE");
  MC_CHECK_ARG(sync == 0 || sync == 1, "MOONCAKE_PG_AUTO_SYNC_ON_FAILURE must be 0 or 1, got ",
               sync);
  MC_CHECK_ARG(deactivate == 1 || sync == 0,
               "MOONCAKE_PG_AUTO_SYNC_ON_FAILURE=1 requires "
               "MOONCAKE_PG_AUTO_DEACTIVATE_ON_FAILURE=1");
  return c10::make_intrusive<MooncakeBackendOptions>(at::Tensor(), false, std::nullopt,
                                                     deactivate == 1, sync == 1);
}

// A response for a change from `before` to `after` that meant to admit
// (`activate`) or remove `asked`.
ProposalResponse proposal_response(const View& before, const View& after,
                                   const std::vector<int>& asked, bool activate) {
  ProposalResponse r;
  r.new_epoch = static_cast<int64_t>(after.epoch);
  for (int q = 0; q < after.capacity(); ++q) {
    const bool named = std::find(asked.begin(), asked.end(), q) != asked.end();
    const bool lost = before.is_member(q) && !after.is_member(q) && (activate || !named);
    if (lost || (activate && named && !after.is_member(q))) r.dropped_ranks.push_back(q);
  }
  r.status =
      r.dropped_ranks.empty() ? ProposalStatus::kApplied : ProposalStatus::kAppliedWithDroppedRanks;
  return r;
}

}  // namespace

// --- the backend ----------------------------------------------------------------------

MooncakeBackend::MooncakeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout,
                                 c10::intrusive_ptr<MooncakeBackendOptions> options,
                                 std::shared_ptr<TransferEngine> engine, const char* name)
    : Backend(rank, size),
      store_(std::make_unique<C10dStore>(store)),
      engine_(std::move(engine)),
      options_(std::move(options)) {
  if (!options_) options_ = options_from_env();
  if (options_->max_world_size.has_value())
    MC_CHECK_ARG(*options_->max_world_size >= size, name, ": max_world_size (",
                 *options_->max_world_size, ") must be >= the world size (", size, ")");
  const int64_t slots = options_->max_world_size.value_or(size);
  if (options_->is_extension)
    MC_CHECK_ARG(rank < slots, name, ": rank ", rank, " must be < max_world_size (", slots, ")");
  if (options_->active_ranks.defined()) {
    const at::Tensor& a = options_->active_ranks;
    MC_CHECK_ARG(a.numel() == slots, name, ": active_ranks must have ", slots,
                 " entries (max_world_size, or the world size), got ", a.numel());
    MC_CHECK_ARG(a.device().is_cpu(), name, ": active_ranks must be on the CPU, got ",
                 a.device().str());
    MC_CHECK_ARG(a.is_contiguous(), name, ": active_ranks must be contiguous");
    active_ranks_ = a;
  } else {
    active_ranks_ = at::ones({slots}, at::TensorOptions().dtype(at::kInt));
  }
  options_->timeout = timeout;
  // pg.set_*_us win over MOONCAKE_PG_TIMEOUT_MS, which wins over `timeout`.
  const GroupDefaults& defaults = group_defaults();
  const int64_t collective_ms = defaults.collective_timeout_ms.load();
  timeout_ms_ =
      collective_ms > 0 ? collective_ms : CommConfig::from_env(timeout.count()).timeout_ms;
  p2p_timeout_ms_ = defaults.p2p_timeout_ms.load();
  CommConfig config = CommConfig::from_env(timeout_ms_);
  config.timeout_ms = timeout_ms_;
  if (!options_->auto_deactivate_on_failure)
    config.recover = kRecoverOff;
  else if (!options_->auto_sync_on_failure)
    config.recover = kRecoverDeferred;
  if (defaults.report_grace_ms.load() >= 0)
    config.report_grace_ms = defaults.report_grace_ms.load();
  // The same store (and group name) may serve several incarnations of a group
  // (init, destroy, init again): number them so no rank reads another's keys.
  // Every rank of one incarnation draws a ticket before any rank of the next;
  // a process joining a running group takes the latest incarnation.
  std::string generation;
  if (options_->is_extension) {
    generation = store_->get("mooncake/latest", timeout_ms_);
  } else {
    const int64_t ticket = store_->add("mooncake/tickets", 1) - 1;
    generation = std::to_string(ticket / size);
    store_->set("mooncake/latest", generation);
  }
  prefix_ = "mooncake/" + generation + "/";
  comm_ = std::make_unique<Communicator>(*engine_, *store_, prefix_, rank, size, config,
                                         static_cast<int>(slots), options_->is_extension);
  extended_size_ = size;
  show_view(comm_->view());
  comm_->set_view_listener([this](const View& view) { show_view(view); });
}

void MooncakeBackend::show_view(const View& view) {
  std::lock_guard<std::mutex> lock(view_mu_);
  auto acc = active_ranks_.accessor<int32_t, 1>();
  for (int i = 0; i < view.capacity(); ++i) acc[i] = view.active[i];
  num_members_ = view.num_members();
  epoch_ = static_cast<int64_t>(view.epoch);
  view_changed(active_ranks_);
  view_version_.fetch_add(1);
}

MooncakeBackend::~MooncakeBackend() {
  shutdown();
}

void MooncakeBackend::shutdown() {
  if (shut_down_.exchange(true)) return;
  if (comm_) comm_->stop();
  queue_->stop();
  std::lock_guard<std::mutex> lock(p2p_mu_);
  if (p2p_) p2p_->stop();
  p2p_.reset();
  comm_.reset();
}

void MooncakeBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ms_ = timeout.count();
}

int64_t MooncakeBackend::op_timeout_ms(std::chrono::milliseconds t) const {
  return t == c10d::kUnsetTimeout ? timeout_ms_ : t.count();
}

int MooncakeBackend::num_synced_ranks() const {
  std::lock_guard<std::mutex> lock(view_mu_);
  return num_members_;
}

std::tuple<int64_t, int64_t, int64_t> MooncakeBackend::timeouts_ms() const {
  MC_CHECK_ARG(comm_ != nullptr, "the process group was shut down");
  return {timeout_ms_, p2p_timeout_ms(), comm_->config().report_grace_ms};
}

int64_t MooncakeBackend::current_epoch() const {
  std::lock_guard<std::mutex> lock(view_mu_);
  return epoch_;
}

bool MooncakeBackend::left_out() const {
  return comm_ && told_left_out(comm_->endpoint(), static_cast<uint64_t>(current_epoch()));
}

// --- elastic membership --------------------------------------------------------------------

void MooncakeBackend::run_on_queue(const char* what, Task task) {
  MC_CHECK_ARG(!shut_down_.load() && comm_, what, ": the process group was shut down");
  auto request = queue_->submit(std::move(task));
  queue_->wait(request, -1);
  if (auto error = request->error()) std::rethrow_exception(error);
}

int MooncakeBackend::list_width(size_t n, const char* op, const char* arg) const {
  if (n == static_cast<size_t>(extended_size_)) return static_cast<int>(n);
  if (extended_size_ != size_ && n != static_cast<size_t>(size_))
    throw_error(ErrorKind::kInvalidArgument, -1, op, ": ", arg, " must have ", size_,
                " entries (the world size) or ", extended_size_,
                " (the size extend_group_size_to admitted), got ", n);
  check_count(n, static_cast<size_t>(size_), op, arg);
  return size_;
}

int MooncakeBackend::parts_width(int64_t whole, int64_t part) const {
  return part > 0 && whole == part * extended_size_ ? static_cast<int>(extended_size_) : size_;
}

void MooncakeBackend::extend_group_size_to(int64_t size) {
  MC_CHECK_ARG(comm_ != nullptr, "extend_group_size_to: the process group was shut down");
  MC_CHECK_ARG(size >= extended_size_ && size <= comm_->capacity(),
               "extend_group_size_to: size must be in [", extended_size_,
               ", max_world_size=", comm_->capacity(), "], got ", size,
               size > comm_->capacity() ? " (reserve slots with MooncakeBackendOptions("
                                          "max_world_size=...) when the group is created)"
                                        : "");
  extended_size_ = size;
}

std::vector<bool> MooncakeBackend::get_peer_state(const std::vector<int64_t>& ranks) {
  std::vector<int> slots(ranks.begin(), ranks.end());
  std::vector<uint8_t> ready;
  run_on_queue("get_peer_state", [&] { ready = comm_->peer_state(slots, timeout_ms_); });
  return std::vector<bool>(ready.begin(), ready.end());
}

ProposalResponse MooncakeBackend::recover_ranks(const std::vector<int64_t>& ranks, bool wait) {
  std::vector<int> slots(ranks.begin(), ranks.end());
  // The extended size is checked inside the collective: members that
  // extended differently fail alike.
  const int limit = static_cast<int>(extended_size_);
  ProposalResponse out;
  run_on_queue("recover_ranks", [&] {
    const View before = comm_->view();
    comm_->admit(slots, timeout_ms_, wait, limit);
    out = proposal_response(before, comm_->view(), slots, /*activate=*/true);
  });
  return out;
}

ProposalResponse MooncakeBackend::deactivate_ranks(const std::vector<int64_t>& ranks) {
  MC_CHECK_ARG(comm_ != nullptr, "deactivate_ranks: the process group was shut down");
  const int64_t slots_n = comm_->capacity();
  for (int64_t r : ranks)
    MC_CHECK_ARG(r >= 0 && r < slots_n,
                 "deactivate_ranks: ranks must be in [0, max_world_size=", slots_n, "), got ", r);
  std::vector<int> slots(ranks.begin(), ranks.end());
  ProposalResponse out;
  run_on_queue("deactivate_ranks", [&] {
    const View before = comm_->view();
    const ViewChange change = comm_->deactivate(slots, timeout_ms_);
    if (!change.rejected.empty()) {
      out.new_epoch = static_cast<int64_t>(change.epoch);
      out.reject_reason = change.rejected;
      return;
    }
    out = proposal_response(before, comm_->view(), slots, /*activate=*/false);
  });
  return out;
}

SyncResponse MooncakeBackend::sync_after_failure() {
  SyncResponse out;
  if (joining()) {
    out.status = SyncStatus::kRejected;
    out.reject_reason =
        "sync_after_failure: this process has not joined the group yet (call pg.join_group)";
    return out;
  }
  run_on_queue("sync_after_failure", [&] {
    out.status = comm_->sync_after_failure(timeout_ms_).settled ? SyncStatus::kReconciled
                                                                : SyncStatus::kNoPending;
  });
  return out;
}

void MooncakeBackend::join_group() {
  MC_CHECK_ARG(comm_ != nullptr, "join_group: the process group was shut down");
  MC_CHECK_ARG(comm_->joining(),
               "join_group: this process group was not created with is_extension=True (or "
               "has joined already)");
  run_on_queue("join_group", [&] { comm_->join(timeout_ms_); });
  // A member now: subgroups created from here on start as members too.
  options_->is_extension = false;
}

uint64_t MooncakeBackend::watch_peers(Endpoint::LossListener fn) {
  MC_CHECK_ARG(comm_ != nullptr, "watch_peers: the group is shut down");
  return comm_->endpoint().watch_peers(std::move(fn), comm_->config().hang_ms);
}

std::string MooncakeBackend::transport_of(int peer) const {
  MC_CHECK_ARG(peer >= 0 && peer < size_, "peer must be in [0, ", size_, "), got ", peer);
  MC_CHECK_ARG(comm_ != nullptr, "the process group was shut down");
  return comm_->transport_of(peer);
}

// --- the op queue and coalescing ---------------------------------------------------------

c10::intrusive_ptr<c10d::Work> MooncakeBackend::wrap(std::shared_ptr<Request> request,
                                                     c10d::OpType type,
                                                     std::vector<at::Tensor> outputs,
                                                     std::weak_ptr<OpQueue> queue,
                                                     FailedRanks failed) {
  if (coalescing_) {
    coalesced_.push_back(request);
    coalesced_failed_.push_back(failed);
  }
  return c10::make_intrusive<MooncakeWork>(rank_, type, std::move(request), std::move(outputs),
                                           std::move(queue), slots(),
                                           std::vector<FailedRanks>{std::move(failed)});
}

std::shared_ptr<Request> MooncakeBackend::submit(Task task) {
  MC_CHECK_ARG(!shut_down_.load(), getBackendName(), ": the process group was shut down");
  return queue_->submit(std::move(task));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::enqueue(c10d::OpType type, Task task,
                                                        std::vector<at::Tensor> outputs,
                                                        bool sync) {
  MC_CHECK_ARG(!shut_down_.load(), getBackendName(), ": the process group was shut down");
  // What the op met of failed peers, for its Work (pg.get_failed_ranks_hint).
  auto failed = std::make_shared<std::vector<int>>();
  Task recorded = [this, task = std::move(task), failed] {
    comm_->take_failed();  // what earlier tasks left (membership calls record too)
    try {
      task();
    } catch (...) {
      *failed = comm_->take_failed();
      throw;
    }
    *failed = comm_->take_failed();
  };
  auto request = sync && !coalescing_ ? queue_->run_now(std::move(recorded))
                                      : queue_->submit(std::move(recorded));
  return wrap(std::move(request), type, std::move(outputs), queue_, std::move(failed));
}

void MooncakeBackend::startCoalescing() {
  MC_CHECK_ARG(!coalescing_, "startCoalescing: already coalescing");
  coalescing_ = true;
  coalesced_.clear();
  coalesced_failed_.clear();
  deferred_.clear();
  batch_error_ = nullptr;
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::endCoalescing() {
  MC_CHECK_ARG(coalescing_, "endCoalescing: startCoalescing was not called");
  coalescing_ = false;
  auto parts = std::exchange(coalesced_, {});
  auto parts_failed = std::exchange(coalesced_failed_, {});
  auto deferred = std::exchange(deferred_, {});
  if (std::exception_ptr error = std::exchange(batch_error_, nullptr)) {
    // All or nothing: the batch's other ops are not posted either.
    for (auto& [post, done] : deferred) done->complete(error);
    std::rethrow_exception(error);
  }
  for (auto& [post, done] : deferred) {
    try {
      std::shared_ptr<Request> request = post();
      request->on_complete([request, done](std::exception_ptr e) {
        done->set_source_rank(request->source_rank());
        done->complete(e);
      });
    } catch (const Error&) {
      done->complete(std::current_exception());
    }
  }
  return c10::make_intrusive<MooncakeWork>(rank_, c10d::OpType::COALESCED, all_of(parts),
                                           std::vector<at::Tensor>{}, std::weak_ptr<OpQueue>{},
                                           slots(), std::move(parts_failed));
}

}  // namespace mooncake
