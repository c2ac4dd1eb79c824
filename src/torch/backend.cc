#include "torch/backend.h"

#include "core/error.h"
#include "store/store.h"
#include "torch/c10d_store.h"
#include "torch/tensor_args.h"
#include "torch/work.h"

namespace mooncake {

// --- options --------------------------------------------------------------------------

MooncakeBackendOptions::MooncakeBackendOptions(at::Tensor active, bool extension,
                                               std::optional<int64_t> max_world)
    : Options("mooncake"),
      active_ranks(std::move(active)),
      is_extension(extension),
      max_world_size(max_world) {
  if (active_ranks.defined()) {
    MC_CHECK_ARG(active_ranks.scalar_type() == at::kInt,
                 "MooncakeBackendOptions: active_ranks must be a torch.int32 tensor, got ",
                 dtype_str(active_ranks.scalar_type()));
    MC_CHECK_ARG(active_ranks.dim() == 1, "MooncakeBackendOptions: active_ranks must be 1-D, got ",
                 active_ranks.dim(), " dims");
  }
  if (max_world_size.has_value())
    MC_CHECK_ARG(*max_world_size >= 1, "MooncakeBackendOptions: max_world_size must be >= 1, got ",
                 *max_world_size);
}

// --- the backend ----------------------------------------------------------------------

MooncakeBackend::MooncakeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout,
                                 c10::intrusive_ptr<MooncakeBackendOptions> options,
                                 std::shared_ptr<TransferEngine> engine, const char* name)
    : Backend(rank, size),
      store_(std::make_unique<C10dStore>(store)),
      engine_(std::move(engine)),
      options_(std::move(options)) {
  if (!options_)
    options_ = c10::make_intrusive<MooncakeBackendOptions>(at::Tensor(), false, std::nullopt);
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
  timeout_ms_ = CommConfig::from_env(timeout.count()).timeout_ms;
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
  comm_ = std::make_unique<Communicator>(*engine_, *store_, prefix_, rank, size,
                                         CommConfig::from_env(timeout_ms_), static_cast<int>(slots),
                                         options_->is_extension);
  extended_size_ = size;
  show_view(comm_->view());
  comm_->set_view_listener([this](const View& view) { show_view(view); });
}

void MooncakeBackend::show_view(const View& view) {
  std::lock_guard<std::mutex> lock(view_mu_);
  auto acc = active_ranks_.accessor<int32_t, 1>();
  for (int i = 0; i < view.capacity(); ++i) acc[i] = view.active[i];
  num_members_ = view.num_members();
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

void MooncakeBackend::recover_ranks(const std::vector<int64_t>& ranks, bool wait) {
  std::vector<int> slots(ranks.begin(), ranks.end());
  // The extended size is checked inside the collective: members that
  // extended differently fail alike.
  const int limit = static_cast<int>(extended_size_);
  run_on_queue("recover_ranks", [&] { comm_->admit(slots, timeout_ms_, wait, limit); });
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

std::string MooncakeBackend::transport_of(int peer) const {
  MC_CHECK_ARG(peer >= 0 && peer < size_, "peer must be in [0, ", size_, "), got ", peer);
  MC_CHECK_ARG(comm_ != nullptr, "the process group was shut down");
  return comm_->transport_of(peer);
}

// --- the op queue and coalescing ---------------------------------------------------------

c10::intrusive_ptr<c10d::Work> MooncakeBackend::wrap(std::shared_ptr<Request> request,
                                                     c10d::OpType type,
                                                     std::vector<at::Tensor> outputs,
                                                     std::weak_ptr<OpQueue> queue) {
  if (coalescing_) coalesced_.push_back(request);
  return c10::make_intrusive<MooncakeWork>(rank_, type, std::move(request), std::move(outputs),
                                           std::move(queue));
}

std::shared_ptr<Request> MooncakeBackend::submit(Task task) {
  MC_CHECK_ARG(!shut_down_.load(), getBackendName(), ": the process group was shut down");
  return queue_->submit(std::move(task));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::enqueue(c10d::OpType type, Task task,
                                                        std::vector<at::Tensor> outputs,
                                                        bool sync) {
  MC_CHECK_ARG(!shut_down_.load(), getBackendName(), ": the process group was shut down");
  auto request =
      sync && !coalescing_ ? queue_->run_now(std::move(task)) : queue_->submit(std::move(task));
  return wrap(std::move(request), type, std::move(outputs), queue_);
}

void MooncakeBackend::startCoalescing() {
  MC_CHECK_ARG(!coalescing_, "startCoalescing: already coalescing");
  coalescing_ = true;
  coalesced_.clear();
  deferred_.clear();
  batch_error_ = nullptr;
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::endCoalescing() {
  MC_CHECK_ARG(coalescing_, "endCoalescing: startCoalescing was not called");
  coalescing_ = false;
  auto parts = std::exchange(coalesced_, {});
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
                                           std::vector<at::Tensor>{});
}

}  // namespace mooncake
