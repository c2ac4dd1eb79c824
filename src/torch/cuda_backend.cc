// MooncakeCudaBackend (cuda_backend.h): the staging of device tensors around
// mooncake-cpu's ops, and the Work that hands the results back on the device.
#if MOONCAKE_WITH_CUDA

#include "torch/cuda_backend.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/ones.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "collectives/layout.h"
#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"
#include "kernels/api.h"
#include "torch/tensor_args.h"
#include "torch/work.h"

namespace mooncake {

namespace {

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> all;
  for (auto& l : lists) all.insert(all.end(), l.begin(), l.end());
  return all;
}

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw_error(ErrorKind::kSystem, -1, "mooncake (CUDA): ", what, ": ", cudaGetErrorString(err));
}

}  // namespace

// A CUDA event of the device current when it is made (without the timing
// that ordering does not need).
class Event {
 public:
  // `blocking`: a host wait for it sleeps instead of spinning.
  explicit Event(bool blocking) {
    cuda_check(cudaEventCreateWithFlags(
                   &event_, cudaEventDisableTiming | (blocking ? cudaEventBlockingSync : 0)),
               "cudaEventCreate");
  }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(cudaStream_t stream) {
    cuda_check(cudaEventRecord(event_, stream), "cudaEventRecord");
  }
  // Work queued on `stream` from now on waits for the event.
  void block(cudaStream_t stream) {
    cuda_check(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
  }
  bool query() {
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    cuda_check(err, "cudaEventQuery");
    return true;
  }
  void synchronize() { cuda_check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }

 private:
  cudaEvent_t event_ = nullptr;
};

namespace {

std::shared_ptr<Event> make_event(bool blocking) {
  return std::make_shared<Event>(blocking);
}

// Waits for `event` on the op thread: staging copies are short, so it polls
// for a while first; then it blocks (the event is made with
// cudaEventBlockingSync, so no core spins while the GPU is busy).
void wait_event(Event& event) {
  const int64_t poll_until = now_us() + 50;
  while (!event.query()) {
    if (now_us() > poll_until) {
      event.synchronize();
      return;
    }
    std::this_thread::yield();
  }
}

// The options mooncake-cpu's half gets: a CUDA active_ranks tensor is kept
// by the CUDA backend, which copies the host one into it on every change.
c10::intrusive_ptr<MooncakeBackendOptions> host_options(
    const c10::intrusive_ptr<MooncakeBackendOptions>& options) {
  if (!options || !options->active_ranks.defined() || options->active_ranks.is_cpu())
    return options;
  auto host = c10::make_intrusive<MooncakeBackendOptions>(
      options->active_ranks.cpu(), options->is_extension, options->max_world_size);
  host->timeout = options->timeout;
  return host;
}

}  // namespace

// One op's results on their way back to the device: copied once the host op
// completes (on the thread that completes it), then `done` is recorded.
struct StagedOp {
  StagedOp(int device, c10::cuda::CUDAStream stream) : device(device), stream(stream) {}

  void copy_back(std::exception_ptr error) noexcept {
    try {
      c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
      c10::cuda::CUDAStreamGuard stream_guard(stream);
      if (!error)
        for (auto& [dev, host] : results) dev.copy_(host, /*non_blocking=*/true);
      done->record(stream);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    // The pinned host copies go back to torch's pool, which reuses them only
    // after the copies recorded on the stream have run.
    results.clear();
    {
      std::lock_guard<std::mutex> lock(mu);
      finished = true;
      failure = error;
    }
    cv.notify_all();
  }

  // Waits up to timeout_ms (< 0: for ever) for copy_back; true when it ran.
  bool wait(int64_t timeout_ms) {
    std::unique_lock<std::mutex> lock(mu);
    if (timeout_ms < 0) {
      cv.wait(lock, [&] { return finished; });
      return true;
    }
    return cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return finished; });
  }
  bool is_finished() {
    std::lock_guard<std::mutex> lock(mu);
    return finished;
  }
  std::exception_ptr error() {
    std::lock_guard<std::mutex> lock(mu);
    return failure;
  }

  const int device;
  const c10::cuda::CUDAStream stream;
  std::vector<std::pair<at::Tensor, at::Tensor>> results;  // (device tensor, host copy)
  std::shared_ptr<Event> done = make_event(false);

 private:
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::exception_ptr failure;
};

// The Work of a staged op (or of a coalesced block of them): done when the
// host op is and its results have been queued back to the device.
class MooncakeCudaWork final : public c10d::Work {
 public:
  MooncakeCudaWork(int rank, c10d::OpType type, c10::intrusive_ptr<c10d::Work> host,
                   std::vector<std::shared_ptr<StagedOp>> stages, int device,
                   c10::cuda::CUDAStream stream, std::vector<at::Tensor> outputs)
      : Work(rank, type),
        host_(std::move(host)),
        stages_(std::move(stages)),
        device_(device),
        outputs_(std::move(outputs)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()),
        std::vector<c10::Device>{c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))});
    // Registered after the stages' copy_back, so it runs after them: the
    // future's events are recorded behind the copies.
    auto future = future_;
    auto outputs_copy = outputs_;
    auto stages_copy = stages_;
    static_cast<MooncakeWork*>(host_.get())
        ->request()
        ->on_complete([future, outputs_copy, stages_copy, device, stream](std::exception_ptr e) {
          for (auto& s : stages_copy)
            if (!e) e = s->error();
          try {
            c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
            c10::cuda::CUDAStreamGuard stream_guard(stream);
            if (e)
              future->setError(e);
            else
              future->markCompleted(c10::IValue(outputs_copy));
          } catch (...) {
          }
        });
  }

  bool isCompleted() override {
    if (!host_->isCompleted()) return false;
    for (auto& s : stages_)
      if (!s->is_finished() || !s->done->query()) return false;
    return true;
  }
  bool isSuccess() const override { return host_->isSuccess() && !stage_error(); }
  std::exception_ptr exception() const override {
    auto e = host_->exception();
    return e ? e : stage_error();
  }
  int sourceRank() const override { return host_->sourceRank(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // Waits for the host op (bounded by `timeout`), then makes the caller's
  // current stream wait for the results' copies; the host never waits for the GPU.
  bool wait(std::chrono::milliseconds timeout) override {
    const Deadline deadline = Deadline::after_ms(timeout == kNoTimeout ? -1 : timeout.count());
    host_->wait(timeout);
    for (auto& s : stages_) {
      if (!s->wait(deadline.infinite() ? -1 : deadline.remaining_ms(INT64_MAX)))
        throw_error(ErrorKind::kTimeout, -1, "Work.wait: the operation did not finish within ",
                    timeout.count(), " ms");
      if (auto e = s->error()) std::rethrow_exception(e);
    }
    synchronize();
    return true;
  }

  void synchronize() override {
    auto current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
    for (auto& s : stages_)
      if (s->is_finished()) s->done->block(current);
  }

 private:
  std::exception_ptr stage_error() const {
    for (auto& s : stages_)
      if (auto e = s->error()) return e;
    return nullptr;
  }

  c10::intrusive_ptr<c10d::Work> host_;
  std::vector<std::shared_ptr<StagedOp>> stages_;
  const int device_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// One op's host copies of its device tensors. CPU tensors pass through
// untouched; an op whose tensors are all on the CPU runs as mooncake-cpu's.
class Staging {
 public:
  Staging(MooncakeCudaBackend& backend, const char* op, MooncakeCudaBackend::Kind kind)
      : b_(backend), op_(op), kind_(kind) {}

  at::Tensor in(const at::Tensor& t, const char* arg) { return mirror(t, arg, true, false); }
  at::Tensor out(const at::Tensor& t, const char* arg) { return mirror(t, arg, false, true); }
  at::Tensor inout(const at::Tensor& t, const char* arg) { return mirror(t, arg, true, true); }
  std::vector<at::Tensor> in(const std::vector<at::Tensor>& ts, const char* arg) {
    return mirrors(ts, arg, true, false);
  }
  std::vector<at::Tensor> out(const std::vector<at::Tensor>& ts, const char* arg) {
    return mirrors(ts, arg, false, true);
  }
  std::vector<at::Tensor> inout(const std::vector<at::Tensor>& ts, const char* arg) {
    return mirrors(ts, arg, true, true);
  }
  std::vector<std::vector<at::Tensor>> in(const std::vector<std::vector<at::Tensor>>& lists,
                                          const char* arg) {
    std::vector<std::vector<at::Tensor>> hosts;
    for (auto& l : lists) hosts.push_back(mirrors(l, arg, true, false));
    return hosts;
  }
  std::vector<std::vector<at::Tensor>> out(const std::vector<std::vector<at::Tensor>>& lists,
                                           const char* arg) {
    std::vector<std::vector<at::Tensor>> hosts;
    for (auto& l : lists) hosts.push_back(mirrors(l, arg, false, true));
    return hosts;
  }
  // An op without tensors (barrier) still runs after the caller's stream has
  // reached it, as NCCL's does.
  void order_after_stream() {
    if (b_.device_ >= 0) start();
  }

  // --- ops on the device plane: no host copies ---
  // `t` itself when contiguous, else a contiguous tensor whose contents are
  // copied into `t` after the op.
  at::Tensor device_out(const at::Tensor& t) {
    start();
    keep(t);
    if (t.is_contiguous()) return t;
    at::Tensor tmp = at::empty(t.sizes(), t.options());
    stage_->results.emplace_back(t, tmp);
    return tmp;
  }
  // Tensors the staging stream reads.
  void keep(const at::Tensor& t) {
    start();
    if (t.storage().data_ptr().get())
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *b_.stream_);
  }
  template <typename Task>
  c10::intrusive_ptr<c10d::Work> run_device(c10d::OpType type, std::vector<at::Tensor> outputs,
                                            Task&& task) {
    start();
    handed_over_ = true;
    stream_guard_.reset();
    device_guard_.reset();
    return finish(b_.enqueue(type, std::forward<Task>(task), outputs), type, outputs);
  }

  // After the host copies are made: the op's tensors must all be on the
  // device or all on the CPU; the host op may start once its inputs are on
  // the host (a send is posted at once, so the caller waits for them).
  void ready() {
    MC_CHECK_ARG(!(stage_ && cpu_arg_), op_, ": tensors must all be on cuda:", b_.device_,
                 " or all on the CPU, but ", cpu_arg_, " is on the CPU");
    if (!stage_) return;
    auto staged = make_event(true);
    staged->record(*b_.stream_);
    if (kind_ == MooncakeCudaBackend::Kind::kSend) {
      wait_event(*staged);
    } else if (kind_ == MooncakeCudaBackend::Kind::kCollective) {
      b_.submit([staged] { wait_event(*staged); });
    }
    stream_guard_.reset();
    device_guard_.reset();
  }

  // Runs `host_op` (mooncake-cpu's op on the host copies) once they are
  // ready; returns the Work for the caller, whose results are `outputs`.
  template <typename HostOp>
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType type, std::vector<at::Tensor> outputs,
                                     HostOp&& host_op) {
    ready();
    handed_over_ = true;
    return finish(host_op(), type, std::move(outputs));
  }
  // Whether mooncake-cpu's op was called (its errors are its own).
  bool handed_over() const { return handed_over_; }

 private:
  // The Work to return for mooncake-cpu's `work` on the host copies.
  c10::intrusive_ptr<c10d::Work> finish(c10::intrusive_ptr<c10d::Work> work, c10d::OpType type,
                                        std::vector<at::Tensor> outputs) {
    if (!stage_) return work;
    auto stage = stage_;
    static_cast<MooncakeWork*>(work.get())->request()->on_complete([stage](std::exception_ptr e) {
      stage->copy_back(e);
    });
    if (b_.staging_coalesced_) b_.coalesced_.push_back(stage);
    return c10::make_intrusive<MooncakeCudaWork>(b_.rank_, type, std::move(work),
                                                 std::vector<std::shared_ptr<StagedOp>>{stage},
                                                 b_.device_, *b_.stream_, std::move(outputs));
  }

  // On the first device tensor: the staging stream waits for the caller's.
  void start() {
    if (stage_) return;
    const auto device = static_cast<c10::DeviceIndex>(b_.device_);
    device_guard_.emplace(device);
    const auto caller = c10::cuda::getCurrentCUDAStream(device);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cuda_check(cudaStreamIsCapturing(caller, &capture), "cudaStreamIsCapturing");
    MC_CHECK_ARG(capture == cudaStreamCaptureStatusNone, op_,
                 ": cannot run under CUDA graph capture (backend mooncake stages device "
                 "tensors through host memory); call it outside the captured region");
    auto ready = make_event(false);
    ready->record(caller);
    ready->block(*b_.stream_);
    stream_guard_.emplace(*b_.stream_);
    stage_ = std::make_shared<StagedOp>(b_.device_, *b_.stream_);
  }

  at::Tensor mirror(const at::Tensor& t, const char* arg, bool copy_in, bool copy_out) {
    // Undefined and sparse tensors go on to mooncake-cpu's checks, which name them.
    if (!t.defined() || t.layout() != at::kStrided) return t;
    if (t.device().is_cpu()) {
      if (!cpu_arg_) cpu_arg_ = arg;
      return t;
    }
    MC_CHECK_ARG(t.is_cuda(), op_, ": ", arg, " must be a CUDA (or CPU) tensor, got ",
                 t.device().str());
    MC_CHECK_ARG(b_.device_ >= 0 && t.device().index() == b_.device_, op_, ": ", arg,
                 " must be on cuda:", b_.device_,
                 " (the device that was current when the group was created), got ",
                 t.device().str());
    start();
    at::Tensor host =
        at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).pinned_memory(true));
    // The staging stream reads or writes `t` after the caller may have let it go.
    if (t.storage().data_ptr().get())
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *b_.stream_);
    if (copy_in) host.copy_(t, /*non_blocking=*/true);
    if (copy_out) stage_->results.emplace_back(t, host);
    return host;
  }

  std::vector<at::Tensor> mirrors(const std::vector<at::Tensor>& ts, const char* arg, bool copy_in,
                                  bool copy_out) {
    std::vector<at::Tensor> hosts;
    hosts.reserve(ts.size());
    for (auto& t : ts) hosts.push_back(mirror(t, arg, copy_in, copy_out));
    return hosts;
  }

  MooncakeCudaBackend& b_;
  const char* op_;
  const MooncakeCudaBackend::Kind kind_;
  bool handed_over_ = false;
  const char* cpu_arg_ = nullptr;  // the first CPU tensor's argument
  std::optional<c10::cuda::CUDAGuard> device_guard_;
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard_;
  std::shared_ptr<StagedOp> stage_;
};

// --- the backend ------------------------------------------------------------------------

MooncakeCudaBackend::MooncakeCudaBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                         int size, std::chrono::milliseconds timeout,
                                         c10::intrusive_ptr<MooncakeBackendOptions> options,
                                         std::shared_ptr<TransferEngine> engine)
    : MooncakeBackend(store, rank, size, timeout, host_options(options), std::move(engine), kName) {
  if (c10::cuda::device_count() > 0) {
    device_ = c10::cuda::current_device();
    stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true,
                                           static_cast<c10::DeviceIndex>(device_));
    plane_min_bytes_ = static_cast<size_t>(env_int("MOONCAKE_CUDA_PLANE_MIN_BYTES"));
    const int64_t bytes = env_int("MOONCAKE_CUDA_SEGMENT_BYTES");
    if (bytes > 0 && env_string("MOONCAKE_TRANSPORT") != "tcp")
      plane_ = std::make_unique<CudaPlane>(MooncakeBackend::store(), prefix(), rank, size, device_,
                                           static_cast<size_t>(bytes));
  }
  const at::Tensor given = options ? options->active_ranks : at::Tensor();
  if (given.defined() && given.is_cuda()) {
    MC_CHECK_ARG(given.device().index() == device_, kName,
                 ": active_ranks must be on cuda:", device_, " (the current device), got ",
                 given.device().str());
    user_active_ = given;
  } else if (!given.defined() && device_ >= 0) {
    user_active_ = at::empty({MooncakeBackend::active_ranks().numel()},
                             at::TensorOptions().dtype(at::kInt).device(
                                 c10::kCUDA, static_cast<c10::DeviceIndex>(device_)));
  }
  view_changed(MooncakeBackend::active_ranks());
}

at::Tensor MooncakeCudaBackend::active_ranks() const {
  return user_active_.defined() ? user_active_ : MooncakeBackend::active_ranks();
}

void MooncakeCudaBackend::view_changed(const at::Tensor& active) {
  if (!user_active_.defined() || !user_active_.is_cuda()) return;
  // On the staging stream, so the ops' done events come after the update.
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
  c10::cuda::CUDAStreamGuard stream_guard(*stream_);
  user_active_.copy_(active);
}

template <typename Build>
c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::staged(const char* op, Kind kind,
                                                           Build&& build) {
  Staging staging(*this, op, kind);
  try {
    return build(staging);
  } catch (const Error& e) {
    // Rejected by the staging (mooncake-cpu's own checks reject for themselves).
    if (!staging.handed_over() && kind == Kind::kCollective &&
        e.kind() == ErrorKind::kInvalidArgument && !shut_down())
      reject_next(e.what());
    throw;
  }
}

// Each op: host copies of its tensors (inputs copied in, outputs copied
// back), then mooncake-cpu's op on them.

// --- the device plane ---------------------------------------------------------------

bool MooncakeCudaBackend::on_plane(const std::vector<at::Tensor>& tensors,
                                   std::optional<size_t> bytes) {
  if (!plane_ || size_ > kernels::kMaxReduceSources) return false;
  if (bytes && (*bytes > plane_->capacity() || *bytes < plane_min_bytes_)) return false;
  // all_to_all_single gives each peer a region of at least 256 bytes.
  if (!bytes && plane_->capacity() < static_cast<size_t>(size_) * 256) return false;
  for (const at::Tensor& t : tensors)
    if (!t.defined() || !t.is_cuda() || t.device().index() != device_ ||
        t.layout() != at::kStrided || t.scalar_type() != tensors.begin()->scalar_type())
      return false;  // the staged path names what is wrong
  try {
    to_dtype(tensors.begin()->scalar_type(), "", "");
  } catch (const Error&) {
    return false;
  }
  return plane_->same_host(timeout_ms());
}

bool MooncakeCudaBackend::on_plane_list(const at::Tensor& one, const std::vector<at::Tensor>& list,
                                        std::optional<size_t> bytes) {
  if (list.size() != static_cast<size_t>(size_) || !one.defined()) return false;
  std::vector<at::Tensor> all{one};
  for (const at::Tensor& t : list) {
    if (!t.defined() || t.numel() != one.numel()) return false;
    all.push_back(t);
  }
  return on_plane(all, bytes);
}

at::Tensor MooncakeCudaBackend::segment_as(const at::Tensor& like, size_t offset) {
  return at::from_blob(plane_->mine(comm().view()) + offset, like.sizes(),
                       at::TensorOptions().dtype(like.scalar_type()).device(like.device()));
}

void MooncakeCudaBackend::wait_stream() {
  if (!stream_done_) stream_done_ = make_event(true);
  stream_done_->record(*stream_);
  wait_event(*stream_done_);
}

void MooncakeCudaBackend::plane_run(
    OpType type, DType dtype, RedOp op, int root, uint64_t numel, int64_t timeout_ms,
    const std::function<void()>& copy_in,
    const std::function<void(const std::vector<int>&, const std::vector<const uint8_t*>&)>& move) {
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
  c10::cuda::CUDAStreamGuard stream_guard(*stream_);
  // The segment is free: the last op's commit round said every member had read it.
  copy_in();
  wait_stream();
  comm().run_external(type, dtype, op, root, numel, timeout_ms,
                      [&](const std::vector<int>& members, const Communicator::ExternalSync& sync) {
                        // Every member's input is in its segment, published: a member that
                        // died before is found here, not by a wait for its segment.
                        sync.barrier();
                        auto segments = plane_->segments(members, comm().view(), timeout_ms);
                        move(members, segments);
                        wait_stream();  // before the commit round lets peers reuse theirs
                      });
}

namespace {

void reduce_segments(const std::vector<const uint8_t*>& segments, size_t offset, void* out,
                     size_t count, DType dtype, RedOp op, cudaStream_t stream) {
  kernels::ReduceArgs a;
  a.nsrc = static_cast<int>(segments.size());
  for (int i = 0; i < a.nsrc; ++i) a.srcs[i] = segments[static_cast<size_t>(i)] + offset;
  a.out = out;
  a.count = count;
  a.dtype = dtype;
  a.op = op;
  a.avg_divisor = a.nsrc;
  cuda_check(static_cast<cudaError_t>(kernels::launch_reduce(a, stream)), "reduce kernel");
}

void check_width(const std::vector<int>& members, int size, const char* op) {
  for (int p : members)
    MC_CHECK_ARG(p < size, op, ": rank ", p, " joined beyond the world size (", size,
                 ") and has no slice in the per-rank tensors");
}

// all_gather's reads: member i's segment into dst[members[i]]; zeros for the
// ranks outside the view.
void gather_segments(const std::vector<int>& members, const std::vector<const uint8_t*>& segments,
                     const std::vector<uint8_t*>& dst, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  std::vector<bool> filled(dst.size(), false);
  for (size_t i = 0; i < members.size(); ++i) {
    filled[static_cast<size_t>(members[i])] = true;
    cuda_check(cudaMemcpyAsync(dst[static_cast<size_t>(members[i])], segments[i], bytes,
                               cudaMemcpyDeviceToDevice, stream),
               "all_gather copy");
  }
  for (size_t p = 0; p < dst.size(); ++p)
    if (!filled[p]) cuda_check(cudaMemsetAsync(dst[p], 0, bytes, stream), "all_gather zero fill");
}

std::vector<uint8_t*> data_ptrs(const std::vector<at::Tensor>& ts) {
  std::vector<uint8_t*> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(static_cast<uint8_t*>(t.data_ptr()));
  return out;
}

}  // namespace

void MooncakeCudaBackend::plane_all_to_all(const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& outputs,
                                           const std::vector<size_t>& in_counts,
                                           const std::vector<size_t>& out_counts, DType dtype,
                                           int64_t timeout_ms) {
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
  c10::cuda::CUDAStreamGuard stream_guard(*stream_);
  std::vector<at::Tensor> ins;  // kept until the op is done
  for (const at::Tensor& t : inputs) ins.push_back(t.contiguous());
  const size_t esize = dtype_size(dtype);
  // src[p] / dst[p]: what this rank sends to / receives from rank p.
  std::vector<const uint8_t*> src(static_cast<size_t>(size_));
  std::vector<uint8_t*> dst = data_ptrs(outputs);
  for (size_t p = 0; p < ins.size(); ++p) src[p] = static_cast<const uint8_t*>(ins[p].data_ptr());
  if (ins.size() == 1) {  // all_to_all_single: slices of one tensor each
    dst.resize(static_cast<size_t>(size_));
    for (size_t p = 1; p < static_cast<size_t>(size_); ++p) {
      src[p] = src[p - 1] + in_counts[p - 1] * esize;
      dst[p] = dst[p - 1] + out_counts[p - 1] * esize;
    }
  }
  // Region p of a rank's segment holds what it sends rank p, one piece per round.
  const size_t region = plane_->capacity() / static_cast<size_t>(size_) / 256 * 256;
  uint8_t* mine = plane_->mine(comm().view());
  auto piece = [&](size_t bytes, size_t k) { return piece_bytes(bytes, region, k); };
  auto copy = [&](void* to, const void* from, size_t len, const char* what) {
    if (len != 0)
      cuda_check(cudaMemcpyAsync(to, from, len, cudaMemcpyDeviceToDevice, *stream_), what);
  };
  comm().run_external(
      OpType::kAllToAll, dtype, RedOp::kSum, -1, 0, timeout_ms,
      [&](const std::vector<int>& members, const Communicator::ExternalSync& sync) {
        check_width(members, size_, "all_to_all_single");
        std::vector<size_t> send(static_cast<size_t>(comm().capacity()), 0), recv = send;
        uint64_t my_rounds = 0;
        for (int p : members) {
          if (p == rank_) continue;
          send[p] = in_counts[p] * esize;
          recv[p] = out_counts[p] * esize;
          my_rounds = std::max(
              {my_rounds, (send[p] + region - 1) / region, (recv[p] + region - 1) / region});
        }
        auto stage = [&](size_t k) {
          for (int p : members)
            if (p != rank_)
              copy(mine + p * region, src[p] + k * region, piece(send[p], k),
                   "all_to_all_single staging");
          wait_stream();
        };
        // Round 0 is staged before the round of headers that checks the
        // sizes, which so also says every member's pieces are in place.
        stage(0);
        const uint64_t rounds = sync.sized(send, recv, my_rounds);
        // After that round every member has published its segment (see plane_run).
        auto segments = plane_->segments(members, comm().view(), timeout_ms);
        copy(dst[rank_], src[rank_], in_counts[rank_] * esize, "all_to_all_single own slice");
        std::vector<bool> member(static_cast<size_t>(size_), false);
        for (int p : members) member[p] = true;
        for (int p = 0; p < size_; ++p)  // ranks outside the view: zeros
          if (!member[p] && out_counts[p] != 0)
            cuda_check(cudaMemsetAsync(dst[p], 0, out_counts[p] * esize, *stream_),
                       "all_to_all_single zero fill");
        for (uint64_t k = 0; k < rounds; ++k) {
          if (k > 0) {
            sync.barrier();  // every member has read round k - 1
            stage(k);
            sync.barrier();  // every member's round k is in place
          }
          for (size_t i = 0; i < members.size(); ++i)
            if (members[i] != rank_)
              copy(dst[members[i]] + k * region, segments[i] + rank_ * region,
                   piece(recv[members[i]], k), "all_to_all_single copy");
          wait_stream();
        }
      });
}

// --- the ops ----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  if (tensors.size() == 1 && root >= 0 && root < size_ &&
      on_plane({tensors[0]}, tensors[0].nbytes())) {
    return staged("broadcast", Kind::kCollective, [&](Staging& s) {
      at::Tensor t = tensors[0];
      const DType dt = to_dtype(t.scalar_type(), "broadcast", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      // The root's tensor is only read; the others' are written (device_out keeps them too).
      const at::Tensor out = rank_ == root ? t : s.device_out(t);
      if (rank_ == root) s.keep(t);
      return s.run_device(c10d::OpType::BROADCAST, {t}, [this, t, out, dt, root, timeout] {
        plane_run(
            OpType::kBroadcast, dt, RedOp::kSum, root, elems(t), timeout,
            [&] {
              if (rank_ == root) segment_as(t).copy_(t);
            },
            [&](const std::vector<int>& members, const std::vector<const uint8_t*>& segments) {
              if (rank_ == root) return;
              const size_t at = std::find(members.begin(), members.end(), root) - members.begin();
              cuda_check(cudaMemcpyAsync(out.data_ptr(), segments[at], t.nbytes(),
                                         cudaMemcpyDeviceToDevice, *stream_),
                         "broadcast copy");
            });
      });
    });
  }
  return staged("broadcast", Kind::kCollective, [&](Staging& s) {
    auto host = s.inout(tensors, "tensor");
    return s.run(c10d::OpType::BROADCAST, tensors,
                 [&] { return MooncakeBackend::broadcast(host, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && on_plane({tensors[0]}, tensors[0].nbytes())) {
    return staged("all_reduce", Kind::kCollective, [&](Staging& s) {
      at::Tensor t = tensors[0];
      const DType dt = to_dtype(t.scalar_type(), "all_reduce", "tensor");
      const RedOp op = to_redop(opts.reduceOp, t, "all_reduce");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      at::Tensor out = s.device_out(t);
      return s.run_device(c10d::OpType::ALLREDUCE, {t}, [this, t, out, dt, op, timeout] {
        plane_run(
            OpType::kAllReduce, dt, op, -1, elems(t), timeout, [&] { segment_as(t).copy_(t); },
            [&](const std::vector<int>&, const std::vector<const uint8_t*>& segments) {
              reduce_segments(segments, 0, out.data_ptr(), elems(t), dt, op, *stream_);
            });
      });
    });
  }
  return staged("all_reduce", Kind::kCollective, [&](Staging& s) {
    auto host = s.inout(tensors, "tensor");
    return s.run(c10d::OpType::ALLREDUCE, tensors,
                 [&] { return MooncakeBackend::allreduce(host, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return staged("all_reduce_coalesced", Kind::kCollective, [&](Staging& s) {
    auto host = s.inout(tensors, "tensors");
    return s.run(c10d::OpType::ALLREDUCE_COALESCED, tensors,
                 [&] { return MooncakeBackend::allreduce_coalesced(host, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  return staged("reduce", Kind::kCollective, [&](Staging& s) {
    auto host = s.inout(tensors, "tensor");
    return s.run(c10d::OpType::REDUCE, tensors,
                 [&] { return MooncakeBackend::reduce(host, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (inputs.size() == 1 && outputs.size() == 1 &&
      on_plane_list(inputs[0], outputs[0], inputs[0].nbytes())) {
    return staged("all_gather", Kind::kCollective, [&](Staging& s) {
      at::Tensor in = inputs[0];
      const DType dt = to_dtype(in.scalar_type(), "all_gather", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      std::vector<at::Tensor> outs;
      for (const at::Tensor& t : outputs[0]) outs.push_back(s.device_out(t));
      return s.run_device(c10d::OpType::ALLGATHER, flat(outputs), [this, in, outs, dt, timeout] {
        plane_run(
            OpType::kAllGather, dt, RedOp::kSum, -1, elems(in), timeout,
            [&] { segment_as(in).copy_(in); },
            [&](const std::vector<int>& members, const std::vector<const uint8_t*>& segments) {
              check_width(members, size_, "all_gather");
              gather_segments(members, segments, data_ptrs(outs), in.nbytes(), *stream_);
            });
      });
    });
  }
  return staged("all_gather", Kind::kCollective, [&](Staging& s) {
    auto ins = s.in(inputs, "tensor");
    auto outs = s.out(outputs, "tensor_list");
    return s.run(c10d::OpType::ALLGATHER, flat(outputs),
                 [&] { return MooncakeBackend::allgather(outs, ins, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  if (output.defined() && input.defined() && output.numel() == input.numel() * size_ &&
      on_plane({input, output}, input.nbytes())) {
    return staged("all_gather_into_tensor", Kind::kCollective, [&](Staging& s) {
      at::Tensor in = input, user_out = output;
      const DType dt = to_dtype(in.scalar_type(), "all_gather_into_tensor", "input_tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      at::Tensor out = s.device_out(user_out);
      return s.run_device(c10d::OpType::_ALLGATHER_BASE, {user_out}, [this, in, out, dt, timeout] {
        const size_t bytes = in.nbytes();
        plane_run(
            OpType::kAllGather, dt, RedOp::kSum, -1, elems(in), timeout,
            [&] { segment_as(in).copy_(in); },
            [&](const std::vector<int>& members, const std::vector<const uint8_t*>& segments) {
              check_width(members, size_, "all_gather_into_tensor");
              auto* base = static_cast<uint8_t*>(out.data_ptr());
              std::vector<uint8_t*> dst;
              for (int p = 0; p < size_; ++p) dst.push_back(base + p * bytes);
              gather_segments(members, segments, dst, bytes, *stream_);
            });
      });
    });
  }
  return staged("all_gather_into_tensor", Kind::kCollective, [&](Staging& s) {
    auto in = s.in(input, "input_tensor");
    auto out = s.out(output, "output_tensor");
    return s.run(c10d::OpType::_ALLGATHER_BASE, {output},
                 [&] { return MooncakeBackend::_allgather_base(out, in, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return staged("all_gather_coalesced", Kind::kCollective, [&](Staging& s) {
    auto ins = s.in(inputs, "input_tensor_list");
    auto outs = s.out(outputs, "output_tensor_lists");
    return s.run(c10d::OpType::ALLGATHER_COALESCED, flat(outputs),
                 [&] { return MooncakeBackend::allgather_coalesced(outs, ins, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return staged("all_gather_into_tensor", Kind::kCollective, [&](Staging& s) {
    auto ins = s.in(inputs, "input_tensor");
    auto outs = s.out(outputs, "output_tensor");
    return s.run(c10d::OpType::COALESCED, outputs,
                 [&] { return MooncakeBackend::allgather_into_tensor_coalesced(outs, ins, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return staged("gather", Kind::kCollective, [&](Staging& s) {
    auto ins = s.in(inputs, "tensor");
    auto outs = s.out(outputs, "gather_list");
    return s.run(c10d::OpType::GATHER, flat(outputs),
                 [&] { return MooncakeBackend::gather(outs, ins, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return staged("scatter", Kind::kCollective, [&](Staging& s) {
    auto ins = s.in(inputs, "scatter_list");
    auto outs = s.out(outputs, "tensor");
    return s.run(c10d::OpType::SCATTER, outputs,
                 [&] { return MooncakeBackend::scatter(outs, ins, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (inputs.size() == 1 && outputs.size() == 1 &&
      on_plane_list(outputs[0], inputs[0], outputs[0].nbytes() * inputs[0].size())) {
    return staged("reduce_scatter", Kind::kCollective, [&](Staging& s) {
      std::vector<at::Tensor> ins = inputs[0];
      at::Tensor user_out = outputs[0];
      const DType dt = to_dtype(user_out.scalar_type(), "reduce_scatter", "output");
      const RedOp op = to_redop(opts.reduceOp, user_out, "reduce_scatter");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      for (const at::Tensor& t : ins) s.keep(t);
      at::Tensor out = s.device_out(user_out);
      return s.run_device(
          c10d::OpType::REDUCE_SCATTER, {user_out}, [this, ins, out, dt, op, timeout] {
            const size_t bytes = out.nbytes();
            plane_run(
                OpType::kReduceScatter, dt, op, -1, elems(out), timeout,
                [&] {  // one slice per rank, as reduce_scatter_tensor's input holds them
                  for (size_t p = 0; p < ins.size(); ++p)
                    segment_as(ins[p], p * bytes).copy_(ins[p]);
                },
                [&](const std::vector<int>& members, const std::vector<const uint8_t*>& segments) {
                  check_width(members, size_, "reduce_scatter");
                  reduce_segments(segments, static_cast<size_t>(rank_) * bytes, out.data_ptr(),
                                  elems(out), dt, op, *stream_);
                });
          });
    });
  }
  return staged("reduce_scatter", Kind::kCollective, [&](Staging& s) {
    auto ins = s.in(inputs, "input_list");
    auto outs = s.out(outputs, "output");
    return s.run(c10d::OpType::REDUCE_SCATTER, outputs,
                 [&] { return MooncakeBackend::reduce_scatter(outs, ins, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (output.defined() && input.defined() && input.numel() == output.numel() * size_ &&
      on_plane({input, output}, input.nbytes())) {
    return staged("reduce_scatter_tensor", Kind::kCollective, [&](Staging& s) {
      at::Tensor in = input, user_out = output;
      const DType dt = to_dtype(in.scalar_type(), "reduce_scatter_tensor", "input");
      const RedOp op = to_redop(opts.reduceOp, in, "reduce_scatter_tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      at::Tensor out = s.device_out(user_out);
      return s.run_device(
          c10d::OpType::_REDUCE_SCATTER_BASE, {user_out}, [this, in, out, dt, op, timeout] {
            plane_run(
                OpType::kReduceScatter, dt, op, -1, elems(out), timeout,
                [&] { segment_as(in).copy_(in); },
                [&](const std::vector<int>& members, const std::vector<const uint8_t*>& segments) {
                  check_width(members, size_, "reduce_scatter_tensor");
                  reduce_segments(segments, static_cast<size_t>(rank_) * out.nbytes(),
                                  out.data_ptr(), elems(out), dt, op, *stream_);
                });
          });
    });
  }
  return staged("reduce_scatter_tensor", Kind::kCollective, [&](Staging& s) {
    auto in = s.in(input, "input");
    auto out = s.out(output, "output");
    return s.run(c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                 [&] { return MooncakeBackend::_reduce_scatter_base(out, in, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return staged("reduce_scatter_tensor", Kind::kCollective, [&](Staging& s) {
    auto ins = s.in(inputs, "input");
    auto outs = s.out(outputs, "output");
    return s.run(c10d::OpType::COALESCED, outputs,
                 [&] { return MooncakeBackend::reduce_scatter_tensor_coalesced(outs, ins, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  // Inputs differ in size from rank to rank, so whether the op takes the
  // plane must not depend on sizes: it does whenever the plane serves the
  // group, for split lists of the world size (longer ones, which reach ranks
  // that joined past it, are staged).
  const auto world = static_cast<size_t>(size_);
  if (input_split_sizes.size() <= world && output_split_sizes.size() <= world &&
      on_plane({input, output}, std::nullopt)) {
    return staged("all_to_all_single", Kind::kCollective, [&](Staging& s) {
      std::vector<size_t> in_counts =
          split_counts(input, input_split_sizes, size_, "input_split_sizes", "input");
      std::vector<size_t> out_counts =
          split_counts(output, output_split_sizes, size_, "output_split_sizes", "output");
      MC_CHECK_ARG(in_counts[rank_] == out_counts[rank_], "all_to_all_single: rank ", rank_,
                   " sends itself ", in_counts[rank_], " elements but expects ", out_counts[rank_],
                   " from itself");
      const DType dt = to_dtype(input.scalar_type(), "all_to_all_single", "input");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(input);
      at::Tensor in = input;
      at::Tensor out = s.device_out(output);
      return s.run_device(c10d::OpType::ALLTOALL_BASE, {output},
                          [this, in, out, in_counts, out_counts, dt, timeout] {
                            plane_all_to_all({in}, {out}, in_counts, out_counts, dt, timeout);
                          });
    });
  }
  return staged("all_to_all_single", Kind::kCollective, [&](Staging& s) {
    auto in = s.in(input, "input");
    auto out = s.out(output, "output");
    return s.run(c10d::OpType::ALLTOALL_BASE, {output}, [&] {
      return MooncakeBackend::alltoall_base(out, in, output_split_sizes, input_split_sizes, opts);
    });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions& opts) {
  // As all_to_all_single: sizes differ between ranks, so any size takes the plane.
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  if (inputs.size() == static_cast<size_t>(size_) && outputs.size() == inputs.size() &&
      on_plane(all, std::nullopt)) {
    return staged("all_to_all", Kind::kCollective, [&](Staging& s) {
      std::vector<size_t> in_counts, out_counts;
      for (const at::Tensor& t : inputs) in_counts.push_back(elems(t));
      for (const at::Tensor& t : outputs) out_counts.push_back(elems(t));
      MC_CHECK_ARG(in_counts[rank_] == out_counts[rank_], "all_to_all: rank ", rank_,
                   " sends itself ", in_counts[rank_], " elements but expects ", out_counts[rank_],
                   " from itself");
      const DType dt = to_dtype(inputs[0].scalar_type(), "all_to_all", "input_tensor_list");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      for (const at::Tensor& t : inputs) s.keep(t);
      std::vector<at::Tensor> ins = inputs, outs;
      for (const at::Tensor& t : outputs) outs.push_back(s.device_out(t));
      return s.run_device(c10d::OpType::ALLTOALL, outputs,
                          [this, ins, outs, in_counts, out_counts, dt, timeout] {
                            plane_all_to_all(ins, outs, in_counts, out_counts, dt, timeout);
                          });
    });
  }
  return staged("all_to_all", Kind::kCollective, [&](Staging& s) {
    auto ins = s.in(inputs, "input_tensor_list");
    auto outs = s.out(outputs, "output_tensor_list");
    return s.run(c10d::OpType::ALLTOALL, outputs,
                 [&] { return MooncakeBackend::alltoall(outs, ins, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::barrier(const c10d::BarrierOptions& opts) {
  return staged("barrier", Kind::kCollective, [&](Staging& s) {
    s.order_after_stream();
    return s.run(c10d::OpType::BARRIER, {}, [&] { return MooncakeBackend::barrier(opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::send(std::vector<at::Tensor>& tensors, int dst,
                                                         int tag) {
  return staged("send", Kind::kSend, [&](Staging& s) {
    auto host = s.in(tensors, "tensor");
    return s.run(c10d::OpType::SEND, tensors,
                 [&] { return MooncakeBackend::send(host, dst, tag); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::recv(std::vector<at::Tensor>& tensors, int src,
                                                         int tag) {
  return staged("recv", Kind::kRecv, [&](Staging& s) {
    auto host = s.out(tensors, "tensor");
    return s.run(c10d::OpType::RECV, tensors,
                 [&] { return MooncakeBackend::recv(host, src, tag); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                  int tag) {
  return recv(tensors, -1, tag);
}

// --- coalescing -------------------------------------------------------------------------

void MooncakeCudaBackend::startCoalescing() {
  MooncakeBackend::startCoalescing();
  staging_coalesced_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::endCoalescing() {
  staging_coalesced_ = false;
  auto stages = std::exchange(coalesced_, {});
  auto work = MooncakeBackend::endCoalescing();
  if (stages.empty()) return work;
  return c10::make_intrusive<MooncakeCudaWork>(rank_, c10d::OpType::COALESCED, std::move(work),
                                               std::move(stages), device_, *stream_,
                                               std::vector<at::Tensor>{});
}

}  // namespace mooncake

#endif  // MOONCAKE_WITH_CUDA
