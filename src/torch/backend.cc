#include "torch/backend.h"

#include <numeric>

#include "core/error.h"
#include "store/store.h"
#include "torch/c10d_store.h"

namespace mooncake {

namespace {

// --- Work -----------------------------------------------------------------------

class MooncakeWork : public c10d::Work {
 public:
  // `queue`, when given, is the queue the request runs on: wait() then helps run it.
  MooncakeWork(int rank, c10d::OpType type, std::shared_ptr<Request> request,
               std::vector<at::Tensor> outputs, std::weak_ptr<OpQueue> queue = {})
      : Work(rank, type),
        request_(std::move(request)),
        outputs_(std::move(outputs)),
        queue_(std::move(queue)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{});
    auto future = future_;
    auto outputs_copy = outputs_;
    request_->on_complete([future, outputs_copy](std::exception_ptr error) {
      if (error)
        future->setError(error);
      else
        future->markCompleted(c10::IValue(outputs_copy));
    });
  }

  bool isCompleted() override { return request_->done(); }
  bool isSuccess() const override { return request_->done() && !request_->error(); }
  std::exception_ptr exception() const override { return request_->error(); }
  int sourceRank() const override { return request_->source_rank(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  bool wait(std::chrono::milliseconds timeout) override {
    int64_t ms = timeout == kNoTimeout ? -1 : timeout.count();
    auto queue = queue_.lock();
    bool done = queue ? queue->wait(request_, ms) : request_->wait(ms);
    if (!done)
      throw_error(ErrorKind::kTimeout, -1, "Work.wait: the operation did not finish within ", ms,
                  " ms");
    if (auto error = request_->error()) std::rethrow_exception(error);
    return true;
  }
  void synchronize() override {}
  const std::shared_ptr<Request>& request() const { return request_; }

 private:
  std::shared_ptr<Request> request_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::weak_ptr<OpQueue> queue_;
};

// --- tensors -----------------------------------------------------------------------

// "torch.int8", as Python users know the dtype.
std::string dtype_str(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

DType to_dtype(at::ScalarType t, const char* op, const char* arg) {
  switch (t) {
    case at::kBool: return DType::kBool;
    case at::kByte: return DType::kUInt8;
    case at::kChar: return DType::kInt8;
    case at::kShort: return DType::kInt16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kUInt16: return DType::kUInt16;
    case at::kUInt32: return DType::kUInt32;
    case at::kUInt64: return DType::kUInt64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kComplexFloat: return DType::kFloat32;  // moved as pairs of floats
    case at::kComplexDouble: return DType::kFloat64;
    default:
      throw_error(ErrorKind::kInvalidArgument, -1, op, ": ", arg, " has dtype ", dtype_str(t),
                  ", which mooncake does not support");
  }
}

// Elements of the core dtype a tensor holds (complex counts twice).
size_t elems(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * (t.is_complex() ? 2 : 1);
}

RedOp to_redop(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) {
  RedOp r;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: r = RedOp::kSum; break;
    case c10d::ReduceOp::AVG: r = RedOp::kAvg; break;
    case c10d::ReduceOp::PRODUCT: r = RedOp::kProduct; break;
    case c10d::ReduceOp::MIN: r = RedOp::kMin; break;
    case c10d::ReduceOp::MAX: r = RedOp::kMax; break;
    case c10d::ReduceOp::BAND: r = RedOp::kBand; break;
    case c10d::ReduceOp::BOR: r = RedOp::kBor; break;
    case c10d::ReduceOp::BXOR: r = RedOp::kBxor; break;
    default:
      throw_error(ErrorKind::kInvalidArgument, -1, name,
                  ": op must be SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR; PREMUL_SUM is "
                  "not supported");
  }
  MC_CHECK_ARG(!t.is_complex() || r == RedOp::kSum || r == RedOp::kAvg, name,
               ": complex tensors support only SUM and AVG");
  DType dt = to_dtype(t.scalar_type(), name, "tensor");
  MC_CHECK_ARG(redop_supported(r, dt), name, ": op ", redop_name(r), " is not defined for dtype ",
               dtype_str(t.scalar_type()),
               r == RedOp::kAvg ? " (AVG needs a floating-point tensor)"
                                : " (bitwise ops need an integer or bool tensor)");
  return r;
}

// A contiguous tensor to write results into, and how to copy them back.
struct OutBuf {
  at::Tensor user, buf;
  explicit OutBuf(const at::Tensor& t) : user(t), buf(t.is_contiguous() ? t : t.contiguous()) {}
  void* ptr() const { return buf.data_ptr(); }
  void commit() const {
    if (!buf.is_same(user)) user.copy_(buf);
  }
};

void check_count(size_t got, size_t want, const char* name, const char* what) {
  MC_CHECK_ARG(got == want, name, ": ", what, " must have ", want, " entries, got ", got);
}

}  // namespace

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
                                 std::shared_ptr<TransferEngine> engine)
    : Backend(rank, size),
      store_(std::make_unique<C10dStore>(store)),
      engine_(std::move(engine)),
      options_(std::move(options)) {
  if (!options_)
    options_ = c10::make_intrusive<MooncakeBackendOptions>(at::Tensor(), false, std::nullopt);
  if (options_->max_world_size.has_value())
    MC_CHECK_ARG(*options_->max_world_size >= size, kName, ": max_world_size (",
                 *options_->max_world_size, ") must be >= the world size (", size, ")");
  const int64_t slots = options_->max_world_size.value_or(size);
  if (options_->is_extension)
    MC_CHECK_ARG(rank < slots, kName, ": rank ", rank, " must be < max_world_size (", slots, ")");
  if (options_->active_ranks.defined()) {
    const at::Tensor& a = options_->active_ranks;
    MC_CHECK_ARG(a.numel() == slots, kName, ": active_ranks must have ", slots,
                 " entries (max_world_size, or the world size), got ", a.numel());
    MC_CHECK_ARG(a.device().is_cpu(), kName, ": active_ranks must be on the CPU, got ",
                 a.device().str());
    MC_CHECK_ARG(a.is_contiguous(), kName, ": active_ranks must be contiguous");
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
  const std::string prefix = "mooncake/" + generation + "/";
  comm_ = std::make_unique<Communicator>(*engine_, *store_, prefix, rank, size,
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

void MooncakeBackend::check_tensor(const at::Tensor& t, const char* op, const char* arg) const {
  MC_CHECK_ARG(t.defined(), op, ": ", arg, " is undefined");
  MC_CHECK_ARG(t.layout() == at::kStrided, op, ": ", arg, " must be a dense (strided) tensor");
  MC_CHECK_ARG(t.device().is_cpu(), op, ": ", arg,
               " must be a CPU tensor for backend mooncake-cpu, got ", t.device().str());
  to_dtype(t.scalar_type(), op, arg);
}

void MooncakeBackend::check_rank(int64_t rank, const char* op, const char* arg,
                                 bool allow_any) const {
  MC_CHECK_ARG((rank >= 0 && rank < size_) || (allow_any && rank == -1), op, ": ", arg,
               " must be in [0, ", size_, ")", allow_any ? " or any source" : "", ", got ", rank);
}

void MooncakeBackend::check_list(const std::vector<at::Tensor>& list, const at::Tensor& like,
                                 const char* op, const char* arg, const char* like_name) const {
  check_count(list.size(), static_cast<size_t>(size_), op, arg);
  for (const auto& t : list) {
    check_tensor(t, op, arg);
    MC_CHECK_ARG(t.numel() == like.numel() && t.scalar_type() == like.scalar_type(), op,
                 ": every tensor in ", arg, " must match the ", like_name, " (", like.numel(),
                 " elements of ", dtype_str(like.scalar_type()), "), got ", t.numel(),
                 " elements of ", dtype_str(t.scalar_type()));
  }
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::wrap(std::shared_ptr<Request> request,
                                                     c10d::OpType type,
                                                     std::vector<at::Tensor> outputs,
                                                     std::weak_ptr<OpQueue> queue) {
  if (coalescing_) coalesced_.push_back(request);
  return c10::make_intrusive<MooncakeWork>(rank_, type, std::move(request), std::move(outputs),
                                           std::move(queue));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::enqueue(c10d::OpType type, Task task,
                                                        std::vector<at::Tensor> outputs) {
  MC_CHECK_ARG(!shut_down_.load(), getBackendName(), ": the process group was shut down");
  return wrap(queue_->submit(std::move(task)), type, std::move(outputs), queue_);
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

// --- collectives ------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> MooncakeBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  return collective([&] {
    check_count(tensors.size(), 1, "broadcast", "tensors");
    check_tensor(tensors[0], "broadcast", "tensor");
    check_rank(opts.rootRank, "broadcast", "src");
    at::Tensor t = tensors[0];
    DType dt = to_dtype(t.scalar_type(), "broadcast", "tensor");
    int root = static_cast<int>(opts.rootRank);
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(c10d::OpType::BROADCAST,
                   [this, t, dt, root, timeout] {
                     OutBuf out(t);
                     comm_->broadcast(out.ptr(), elems(t), dt, root, timeout);
                     out.commit();
                   },
                   {t});
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  return collective([&] {
    check_count(tensors.size(), 1, "all_reduce", "tensors");
    check_tensor(tensors[0], "all_reduce", "tensor");
    at::Tensor t = tensors[0];
    DType dt = to_dtype(t.scalar_type(), "all_reduce", "tensor");
    RedOp op = to_redop(opts.reduceOp, t, "all_reduce");
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(c10d::OpType::ALLREDUCE,
                   [this, t, dt, op, timeout] {
                     OutBuf out(t);
                     comm_->all_reduce(out.ptr(), elems(t), dt, op, timeout);
                     out.commit();
                   },
                   {t});
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return collective([&] {
    std::vector<std::tuple<at::Tensor, DType, RedOp>> items;
    for (auto& t : tensors) {
      check_tensor(t, "all_reduce_coalesced", "tensors");
      items.emplace_back(t, to_dtype(t.scalar_type(), "all_reduce_coalesced", "tensors"),
                         to_redop(opts.reduceOp, t, "all_reduce_coalesced"));
    }
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::ALLREDUCE_COALESCED,
        [this, items, timeout] {
          for (auto& [t, dt, op] : items) {
            OutBuf out(t);
            comm_->all_reduce(out.ptr(), elems(t), dt, op, timeout);
            out.commit();
          }
        },
        tensors);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  return collective([&] {
    check_count(tensors.size(), 1, "reduce", "tensors");
    check_tensor(tensors[0], "reduce", "tensor");
    check_rank(opts.rootRank, "reduce", "dst");
    at::Tensor t = tensors[0];
    DType dt = to_dtype(t.scalar_type(), "reduce", "tensor");
    RedOp op = to_redop(opts.reduceOp, t, "reduce");
    int root = static_cast<int>(opts.rootRank);
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(c10d::OpType::REDUCE,
                   [this, t, dt, op, root, timeout] {
                     OutBuf out(t);
                     comm_->reduce(out.ptr(), elems(t), dt, op, root, timeout);
                     if (rank_ == root) out.commit();
                   },
                   {t});
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return collective([&] {
    check_count(inputs.size(), 1, "all_gather", "input tensors");
    check_count(outputs.size(), 1, "all_gather", "output tensor lists");
    at::Tensor in = inputs[0];
    check_tensor(in, "all_gather", "tensor");
    check_list(outputs[0], in, "all_gather", "tensor_list", "input tensor");
    DType dt = to_dtype(in.scalar_type(), "all_gather", "tensor");
    std::vector<at::Tensor> outs = outputs[0];
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::ALLGATHER,
        [this, in, outs, dt, timeout] {
          at::Tensor src = in.contiguous();
          std::vector<OutBuf> bufs;
          std::vector<void*> ptrs;
          for (auto& o : outs) {
            bufs.emplace_back(o);
            ptrs.push_back(bufs.back().ptr());
          }
          comm_->all_gather(src.data_ptr(), elems(src), dt, ptrs.data(), timeout);
          for (auto& b : bufs) b.commit();
        },
        outs);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return allgather_into_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  check_count(outputs.size(), inputs.size(), "all_gather_coalesced", "output_tensor_lists");
  std::vector<std::shared_ptr<Request>> parts;
  std::vector<at::Tensor> results;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<std::vector<at::Tensor>> o{outputs[i]};
    std::vector<at::Tensor> in{inputs[i]};
    auto work = allgather(o, in, opts);
    parts.push_back(static_cast<MooncakeWork*>(work.get())->request());
    results.insert(results.end(), outputs[i].begin(), outputs[i].end());
  }
  return c10::make_intrusive<MooncakeWork>(rank_, c10d::OpType::ALLGATHER_COALESCED, all_of(parts),
                                           results);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), inputs.size(), "all_gather_into_tensor", "output tensors");
    std::vector<std::tuple<at::Tensor, at::Tensor, DType>> items;
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_tensor(inputs[i], "all_gather_into_tensor", "input_tensor");
      check_tensor(outputs[i], "all_gather_into_tensor", "output_tensor");
      MC_CHECK_ARG(outputs[i].scalar_type() == inputs[i].scalar_type(),
                   "all_gather_into_tensor: output_tensor dtype ",
                   dtype_str(outputs[i].scalar_type()), " differs from input_tensor dtype ",
                   dtype_str(inputs[i].scalar_type()));
      MC_CHECK_ARG(outputs[i].numel() == inputs[i].numel() * size_,
                   "all_gather_into_tensor: output_tensor must have world_size * input numel = ",
                   inputs[i].numel() * size_, " elements, got ", outputs[i].numel());
      items.emplace_back(
          outputs[i], inputs[i],
          to_dtype(inputs[i].scalar_type(), "all_gather_into_tensor", "input_tensor"));
    }
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::_ALLGATHER_BASE,
        [this, items, timeout] {
          for (auto& [output, input, dt] : items) {
            at::Tensor src = input.contiguous();
            OutBuf out(output);
            size_t bytes = src.nbytes();
            std::vector<void*> ptrs;
            for (int p = 0; p < size_; ++p)
              ptrs.push_back(static_cast<uint8_t*>(out.ptr()) + p * bytes);
            comm_->all_gather(src.data_ptr(), elems(src), dt, ptrs.data(), timeout);
            out.commit();
          }
        },
        outputs);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return collective([&] {
    check_count(inputs.size(), 1, "gather", "input tensors");
    check_rank(opts.rootRank, "gather", "dst");
    at::Tensor in = inputs[0];
    check_tensor(in, "gather", "tensor");
    int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> outs;
    if (rank_ == root) {
      check_count(outputs.size(), 1, "gather", "output tensor lists");
      check_list(outputs[0], in, "gather", "gather_list", "input tensor");
      outs = outputs[0];
    } else {
      MC_CHECK_ARG(outputs.empty() || outputs[0].empty(),
                   "gather: gather_list must be empty on non-destination ranks");
    }
    DType dt = to_dtype(in.scalar_type(), "gather", "tensor");
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::GATHER,
        [this, in, outs, dt, root, timeout] {
          at::Tensor src = in.contiguous();
          std::vector<OutBuf> bufs;
          std::vector<void*> ptrs;
          for (auto& o : outs) {
            bufs.emplace_back(o);
            ptrs.push_back(bufs.back().ptr());
          }
          comm_->gather(src.data_ptr(), elems(src), dt, ptrs.data(), root, timeout);
          for (auto& b : bufs) b.commit();
        },
        outs);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), 1, "scatter", "output tensors");
    check_rank(opts.rootRank, "scatter", "src");
    at::Tensor out = outputs[0];
    check_tensor(out, "scatter", "tensor");
    int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> ins;
    if (rank_ == root) {
      check_count(inputs.size(), 1, "scatter", "input tensor lists");
      check_list(inputs[0], out, "scatter", "scatter_list", "output tensor");
      for (auto& i : inputs[0]) ins.push_back(i.contiguous());
    } else {
      MC_CHECK_ARG(inputs.empty() || inputs[0].empty(),
                   "scatter: scatter_list must be empty on non-source ranks");
    }
    DType dt = to_dtype(out.scalar_type(), "scatter", "tensor");
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(c10d::OpType::SCATTER,
                   [this, out, ins, dt, root, timeout] {
                     OutBuf buf(out);
                     std::vector<const void*> ptrs;
                     for (auto& i : ins) ptrs.push_back(i.data_ptr());
                     comm_->scatter(ptrs.data(), buf.ptr(), elems(out), dt, root, timeout);
                     buf.commit();
                   },
                   {out});
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), 1, "reduce_scatter", "output tensors");
    check_count(inputs.size(), 1, "reduce_scatter", "input tensor lists");
    check_count(inputs[0].size(), static_cast<size_t>(size_), "reduce_scatter", "input_list");
    at::Tensor out = outputs[0];
    check_tensor(out, "reduce_scatter", "output");
    std::vector<at::Tensor> ins;
    check_list(inputs[0], out, "reduce_scatter", "input_list", "output tensor");
    for (auto& i : inputs[0]) ins.push_back(i.contiguous());
    DType dt = to_dtype(out.scalar_type(), "reduce_scatter", "output");
    RedOp op = to_redop(opts.reduceOp, out, "reduce_scatter");
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(c10d::OpType::REDUCE_SCATTER,
                   [this, out, ins, dt, op, timeout] {
                     OutBuf buf(out);
                     std::vector<const void*> ptrs;
                     for (auto& i : ins) ptrs.push_back(i.data_ptr());
                     comm_->reduce_scatter(ptrs.data(), buf.ptr(), elems(out), dt, op, timeout);
                     buf.commit();
                   },
                   {out});
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return reduce_scatter_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), inputs.size(), "reduce_scatter_tensor", "output tensors");
    std::vector<std::tuple<at::Tensor, at::Tensor, DType, RedOp>> items;
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_tensor(inputs[i], "reduce_scatter_tensor", "input");
      check_tensor(outputs[i], "reduce_scatter_tensor", "output");
      MC_CHECK_ARG(outputs[i].scalar_type() == inputs[i].scalar_type(),
                   "reduce_scatter_tensor: output dtype differs from input dtype");
      MC_CHECK_ARG(inputs[i].numel() == outputs[i].numel() * size_,
                   "reduce_scatter_tensor: input must have world_size * output numel = ",
                   outputs[i].numel() * size_, " elements, got ", inputs[i].numel());
      items.emplace_back(outputs[i], inputs[i],
                         to_dtype(inputs[i].scalar_type(), "reduce_scatter_tensor", "input"),
                         to_redop(opts.reduceOp, inputs[i], "reduce_scatter_tensor"));
    }
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::_REDUCE_SCATTER_BASE,
        [this, items, timeout] {
          for (auto& [output, input, dt, op] : items) {
            at::Tensor src = input.contiguous();
            OutBuf out(output);
            size_t bytes = out.buf.nbytes();
            std::vector<const void*> ptrs;
            for (int p = 0; p < size_; ++p)
              ptrs.push_back(static_cast<const uint8_t*>(src.data_ptr()) + p * bytes);
            comm_->reduce_scatter(ptrs.data(), out.ptr(), elems(output), dt, op, timeout);
            out.commit();
          }
        },
        outputs);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  return collective([&] {
    check_tensor(input, "all_to_all_single", "input");
    check_tensor(output, "all_to_all_single", "output");
    MC_CHECK_ARG(input.scalar_type() == output.scalar_type(),
                 "all_to_all_single: output dtype differs from input dtype");
    // Splits are along dim 0, in rows of the remaining dims.
    auto splits = [&](const at::Tensor& t, const std::vector<int64_t>& given, const char* arg,
                      const char* tensor) {
      const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
      std::vector<size_t> counts(static_cast<size_t>(size_));
      const size_t row = rows == 0 ? 0 : elems(t) / static_cast<size_t>(rows);
      if (given.empty()) {
        MC_CHECK_ARG(rows % size_ == 0, "all_to_all_single: ", tensor, " dim 0 (", rows,
                     ") must be divisible by the world size (", size_, ") when ", arg,
                     " is not given");
        for (auto& c : counts) c = static_cast<size_t>(rows / size_) * row;
      } else {
        check_count(given.size(), static_cast<size_t>(size_), "all_to_all_single", arg);
        int64_t total = 0;
        for (int p = 0; p < size_; ++p) {
          MC_CHECK_ARG(given[p] >= 0, "all_to_all_single: ", arg, " must be >= 0, got ", given[p]);
          counts[p] = static_cast<size_t>(given[p]) * row;
          total += given[p];
        }
        MC_CHECK_ARG(total == rows, "all_to_all_single: ", arg, " sum to ", total, " but ", tensor,
                     " dim 0 has ", rows, " rows");
      }
      return counts;
    };
    std::vector<size_t> in_counts = splits(input, input_split_sizes, "input_split_sizes", "input");
    std::vector<size_t> out_counts =
        splits(output, output_split_sizes, "output_split_sizes", "output");
    DType dt = to_dtype(input.scalar_type(), "all_to_all_single", "input");
    int64_t timeout = op_timeout_ms(opts.timeout);
    at::Tensor in = input, out = output;
    return enqueue(c10d::OpType::ALLTOALL_BASE,
                   [this, in, out, in_counts, out_counts, dt, timeout] {
                     at::Tensor src = in.contiguous();
                     OutBuf buf(out);
                     const size_t esize = dtype_size(dt);
                     std::vector<const void*> ins;
                     std::vector<void*> outs;
                     size_t a = 0, b = 0;
                     for (int p = 0; p < size_; ++p) {
                       ins.push_back(static_cast<const uint8_t*>(src.data_ptr()) + a * esize);
                       outs.push_back(static_cast<uint8_t*>(buf.ptr()) + b * esize);
                       a += in_counts[p];
                       b += out_counts[p];
                     }
                     comm_->all_to_all(ins.data(), in_counts.data(), outs.data(), out_counts.data(),
                                       dt, timeout);
                     buf.commit();
                   },
                   {output});
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), static_cast<size_t>(size_), "all_to_all", "output_tensor_list");
    check_count(inputs.size(), static_cast<size_t>(size_), "all_to_all", "input_tensor_list");
    for (auto& t : inputs) check_tensor(t, "all_to_all", "input_tensor_list");
    for (auto& t : outputs) {
      check_tensor(t, "all_to_all", "output_tensor_list");
      MC_CHECK_ARG(t.scalar_type() == inputs[0].scalar_type(),
                   "all_to_all: every tensor must have the same dtype");
    }
    DType dt = to_dtype(inputs[0].scalar_type(), "all_to_all", "input_tensor_list");
    std::vector<at::Tensor> ins, outs = outputs;
    for (auto& t : inputs) {
      MC_CHECK_ARG(t.scalar_type() == inputs[0].scalar_type(),
                   "all_to_all: every tensor must have the same dtype");
      ins.push_back(t.contiguous());
    }
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::ALLTOALL,
        [this, ins, outs, dt, timeout] {
          std::vector<OutBuf> bufs;
          std::vector<const void*> in_ptrs;
          std::vector<void*> out_ptrs;
          std::vector<size_t> in_counts, out_counts;
          for (int p = 0; p < size_; ++p) {
            bufs.emplace_back(outs[p]);
            in_ptrs.push_back(ins[p].data_ptr());
            in_counts.push_back(elems(ins[p]));
            out_ptrs.push_back(bufs.back().ptr());
            out_counts.push_back(elems(outs[p]));
          }
          comm_->all_to_all(in_ptrs.data(), in_counts.data(), out_ptrs.data(), out_counts.data(),
                            dt, timeout);
          for (auto& b : bufs) b.commit();
        },
        outputs);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::barrier(const c10d::BarrierOptions& opts) {
  int64_t timeout = op_timeout_ms(opts.timeout);
  return enqueue(c10d::OpType::BARRIER, [this, timeout] { comm_->barrier(timeout); }, {});
}

// --- point to point -------------------------------------------------------------------------

P2P& MooncakeBackend::p2p() {
  std::lock_guard<std::mutex> lock(p2p_mu_);
  MC_CHECK_ARG(comm_ != nullptr, getBackendName(), ": the process group was shut down");
  if (!p2p_)
    p2p_ = std::make_unique<P2P>(comm_->p2p_channels(), rank_, comm_->capacity(), timeout_ms_);
  return *p2p_;
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::send(std::vector<at::Tensor>& tensors, int dst,
                                                     int tag) {
  return p2p_op(c10d::OpType::SEND, {tensors.empty() ? at::Tensor() : tensors[0]}, [&]() -> Post {
    check_count(tensors.size(), 1, "send", "tensors");
    check_tensor(tensors[0], "send", "tensor");
    check_rank(dst, "send", "dst");
    at::Tensor t = tensors[0].contiguous();
    return [this, t, dst, tag] {
      auto request = p2p().send(t.data_ptr(), t.nbytes(), dst, static_cast<uint64_t>(tag));
      request->on_complete([t](std::exception_ptr) {});  // keeps the tensor alive until sent
      return request;
    };
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::recv(std::vector<at::Tensor>& tensors, int src,
                                                     int tag) {
  return p2p_op(c10d::OpType::RECV, {tensors.empty() ? at::Tensor() : tensors[0]}, [&]() -> Post {
    check_count(tensors.size(), 1, "recv", "tensors");
    check_tensor(tensors[0], "recv", "tensor");
    check_rank(src, "recv", "src", /*allow_any=*/true);
    at::Tensor user = tensors[0];
    at::Tensor buf = user.is_contiguous() ? user : user.contiguous();
    return [this, user, buf, src, tag] {
      auto request = p2p().recv(buf.data_ptr(), buf.nbytes(), src, static_cast<uint64_t>(tag));
      auto done = std::make_shared<Request>();
      request->on_complete([user, buf, request, done](std::exception_ptr e) {
        if (!e && !buf.is_same(user)) user.copy_(buf);
        done->set_source_rank(request->source_rank());
        done->complete(e);
      });
      return done;
    };
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::p2p_op(c10d::OpType type,
                                                       std::vector<at::Tensor> outputs,
                                                       const std::function<Post()>& check) {
  if (!coalescing_) return wrap(check()(), type, std::move(outputs));
  auto done = std::make_shared<Request>();
  try {
    deferred_.push_back({check(), done});
  } catch (const Error&) {
    if (!batch_error_) batch_error_ = std::current_exception();
    done->complete(std::current_exception());
  }
  return wrap(done, type, std::move(outputs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                              int tag) {
  return recv(tensors, -1, tag);
}

}  // namespace mooncake
