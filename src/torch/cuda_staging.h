// The staging of the "mooncake" backend's device tensors (cuda_backend.h):
// host copies of an op's tensors around mooncake-cpu's op, the Work that
// hands the results back on the device, and the same Work for ops that run
// on the device collectives (device/collectives.h) instead; and the Work of
// an all_reduce launched on the caller's stream (DeviceWork). Included by
// cuda_backend.cc only: Staging is the backend's friend.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "device/cuda.h"
#include "torch/cuda_backend.h"
#include "torch/work.h"

namespace mooncake {

inline std::shared_ptr<CudaEvent> make_event(bool blocking) {
  return std::make_shared<CudaEvent>(blocking);
}

// One op's results on their way back to the device: copied once the host op
// completes (on the thread that completes it), then `done` is recorded.
struct StagedOp {
  StagedOp(int device, c10::cuda::CUDAStream stream) : device(device), stream(stream) {}

  void copy_back(std::exception_ptr error) noexcept {
    // The completing thread, while the caller may capture: the copies, and the
    // pinned host copies' return to torch's pool (which records events).
    const RelaxedCapture relaxed;
    try {
      c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
      c10::cuda::CUDAStreamGuard stream_guard(stream);
      if (!error && land) land(stream.stream());
      if (!error)
        for (auto& [dev, host] : results) dev.copy_(host, /*non_blocking=*/true);
      done->record(stream);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    // The pool reuses them only after the copies recorded on the stream have run.
    results.clear();
    land = nullptr;
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
  // A recv whose bytes come device to device (p2p_buffers.h): run first, on
  // the stream, where the host op succeeded (what it raises fails the op).
  std::function<void(cudaStream_t)> land;
  std::shared_ptr<CudaEvent> done = make_event(false);

 private:
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::exception_ptr failure;
};

// The Work of a staged op (or of a coalesced block of them): done when the
// host op is and its results have been queued back to the device.
class MooncakeCudaWork final : public c10d::Work, public WrapsMooncakeWork {
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
            const RelaxedCapture relaxed;  // as copy_back
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
    // Any thread may ask, one that captures too: these events are never captured.
    const RelaxedCapture relaxed;
    for (auto& s : stages_)
      if (!s->is_finished() || !s->done->query()) return false;
    return true;
  }
  const std::vector<std::shared_ptr<StagedOp>>& stages() const { return stages_; }
  bool isSuccess() const override { return host_->isSuccess() && !stage_error(); }
  std::exception_ptr exception() const override {
    auto e = host_->exception();
    return e ? e : stage_error();
  }
  int sourceRank() const override { return host_->sourceRank(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  MooncakeWork& mooncake_work() const override { return *static_cast<MooncakeWork*>(host_.get()); }

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

// An eager launch whose outcome its Work checks (DirectCall::watch): the slot
// it writes, the op's name and root (-1: none, the list forms).
struct WatchedLaunch {
  DirectOutcomes::Lease lease;
  const char* op = "";
  int root = -1;
  bool rejected = false;  // this rank's own call (it raises at the call)
};

// What a watched launch of `op` found, raised as the host-driven plane raises
// it (`me`: this rank): a peer that rejected its call or called another op
// (ValueError), this rank left out (LeftOutError), a root whose input never
// came (PeerFailedError naming it). A lost rank other than the root only
// leaves its part out (zeros, or the survivors' reduction), as the plane's
// re-run among the survivors does. (`o`: what the launch wrote; a launch that
// wrote nothing ran on the plane, which raised for itself.)
inline void raise_outcome(const WatchedLaunch& w, const kernels::DirectOutcome& o, int me) {
  if (w.rejected) return;
  const auto first = [](uint64_t bits) { return __builtin_ctzll(bits); };
  if (o.rejected != 0)
    throw_error(ErrorKind::kInvalidArgument, -1, w.op, ": rank ", first(o.rejected),
                " rejected its arguments (it raised ValueError); this rank's result leaves it out");
  if (o.mismatched != 0)
    throw_error(ErrorKind::kInvalidArgument, -1, w.op, ": rank ", first(o.mismatched),
                " called another op, or this one with another root, count, dtype or reduce op; "
                "this rank's result leaves it out");
  if (o.sizes != 0)
    throw_error(ErrorKind::kInvalidArgument, -1, w.op, ": ranks ", first(o.sizes), " and ",
                63 - __builtin_clzll(o.sizes),
                " disagree on the split sizes of the parts between them (what one sends, in "
                "elements, the other must expect); no rank's output was written");
  if (o.stale != 0)
    throw_error(ErrorKind::kLeftOut, me, w.op, ": rank ", first(o.stale),
                " had gone on without this rank: the others left it out");
  // This rank's own bit is clear only where a peer fenced it (its own rejected
  // call returned above).
  const uint64_t took = o.took;
  if ((took >> me & 1) == 0)
    throw_error(ErrorKind::kLeftOut, me, w.op,
                ": a peer stopped waiting for this rank and fenced it (it was silent past the "
                "op's timeout, or seen lost): its ops leave it out until the group's ranks next "
                "change");
  if (w.root >= 0 && (took >> w.root & 1) == 0)
    throw_error(ErrorKind::kPeerFailed, w.root, w.op, ": the root, rank ", w.root,
                ", failed or was masked before its part of the op was in place");
}

// The checked launches of one op (DirectCall::watch), shared by its Work and
// the backend: checked once, by whichever comes first, the Work's wait() or
// the backend's next op (settle_watched), each on its own thread.
struct WatchedOps {
  WatchedOps(std::vector<WatchedLaunch> launches, int me, uint64_t members, cudaStream_t stream)
      : launches(std::move(launches)), me(me), members(members), done(make_event(true)) {
    done->record(stream);
  }

  // Waits on the host for what the launches found (wait_found), then reads
  // it: the error to raise, and whether the host's view must catch up
  // (DeviceCollectives::direct_resync): a member of the group (`members`, the
  // view they were launched in) whose signal never came (lost, or fenced by
  // the others), or this rank fenced (so that it meets the others in their
  // setup, which then decides on it). Every survivor of a launch finds the same.
  void check() {
    std::lock_guard<std::mutex> lock(mu);
    if (checked) return;
    {
      const RelaxedCapture relaxed;  // another thread may be capturing meanwhile
      wait_found();
    }
    checked = true;
    const uint64_t mine = uint64_t{1} << me;
    std::vector<std::pair<const WatchedLaunch*, kernels::DirectOutcome>> found;
    for (const WatchedLaunch& w : launches) {
      const std::optional<kernels::DirectOutcome> o = w.lease.read();
      if (!o) continue;
      if ((members & ~o->present & ~mine) != 0) lost = true;
      if ((o->present & mine) == 0) lost = true;  // fenced
      found.emplace_back(&w, *o);
    }
    try {
      for (const auto& [w, o] : found) raise_outcome(*w, o, me);
    } catch (...) {
      error = std::current_exception();
    }
    launches.clear();  // the slots go back
  }
  // Each launch writes what it found once it has decided who takes part,
  // before its data moves: the host waits for those words, not for the
  // launches' end, so that the caller's next launch is queued while this
  // one's data still moves (as after an all_reduce, which is not watched).
  // A launch that ran another way (on the plane) writes none: then its end.
  // Polls, yielding, for up to kPollUs; past that (a peer is late) it waits for
  // the launches' end, sleeping. No short sleeps between looks: the timer's
  // slack makes a 20 us sleep take 60-70 us, which is what a 4-process run on
  // the H100 showed (watched ops at 65-93 us against 14-30 in the other runs).
  // Bounded, as every wait in a launch is.
  void wait_found() {
    const int64_t start = now_us();
    for (;;) {
      bool all = true;
      for (const WatchedLaunch& w : launches) all = all && w.lease.read().has_value();
      if (all || done->query()) return;
      if (now_us() - start > kPollUs) {
        done->wait();
        return;
      }
      std::this_thread::yield();
    }
  }
  static constexpr int64_t kPollUs = 300;

  // check(), then raises what the launches found, if anything.
  void raise_found() {
    check();
    if (error) std::rethrow_exception(error);
  }

  std::vector<WatchedLaunch> launches;
  const int me;
  const uint64_t members;  // bit per slot
  std::shared_ptr<CudaEvent> done;
  std::mutex mu;
  bool checked = false;
  bool lost = false;
  std::exception_ptr error;
};

// The Work of an op launched on the caller's current stream (on the
// device-driven kernels, outside the op queue): the host's part is done
// when it is returned; the device's is ordered on that stream like any kernel
// the caller queued there. Under CUDA graph capture it is part of the graph:
// wait() does nothing then, and the future is completed on the host. With
// watched launches, wait() also waits on the host for them and raises what
// they found (raise_outcome).
class DeviceWork final : public c10d::Work, public WrapsMooncakeWork {
 public:
  DeviceWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, int device,
             c10::cuda::CUDAStream stream, bool captured, int slots,
             std::shared_ptr<WatchedOps> watched = nullptr)
      : Work(rank, type),
        outputs_(std::move(outputs)),
        device_(device),
        stream_(stream),
        captured_(captured),
        host_(c10::make_intrusive<MooncakeWork>(rank, type, done_request(), outputs_,
                                                std::weak_ptr<OpQueue>{}, slots)),
        watched_(std::move(watched)) {}

  bool isCompleted() override {
    if (captured_) return true;
    // A query of a stream that is capturing would end the capture in error.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cuda_check(cudaStreamIsCapturing(stream_.stream(), &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) return false;
    const RelaxedCapture relaxed;  // a query of this stream, which is not capturing
    const cudaError_t err = cudaStreamQuery(stream_.stream());
    if (err == cudaErrorNotReady) return false;
    cuda_check(err, "cudaStreamQuery");
    return true;
  }
  bool isSuccess() const override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  MooncakeWork& mooncake_work() const override { return *host_; }

  bool wait(std::chrono::milliseconds) override {
    synchronize();  // first: a caller that catches what it raises still gets the order
    if (watched_) watched_->raise_found();
    return true;
  }
  // The caller's current stream waits for the op (nothing to do on the
  // stream it was launched on).
  void synchronize() override {
    if (captured_) return;
    c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
    const auto current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
    if (current == stream_) return;
    CudaEvent done(false);
    done.record(stream_.stream());
    done.block(current.stream());
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!future_) {
      std::vector<c10::Device> devices;
      if (!captured_) devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), devices);
      if (watched_) {
        // What the launches found is known only once each has decided: a pool
        // thread waits for that (bounded, as wait() is) and completes the
        // future with their error, as the plane's future would carry it.
        at::launch(
            [future = future_, watched = watched_, outputs = outputs_, device = device_,
             stream = stream_] { complete(*future, watched.get(), outputs, device, stream); });
      } else {
        complete(*future_, nullptr, outputs_, device_, stream_);
      }
    }
    return future_;
  }

 private:
  static void complete(c10::ivalue::Future& future, WatchedOps* watched,
                       const std::vector<at::Tensor>& outputs, int device,
                       c10::cuda::CUDAStream stream) {
    // The op's device current, on a pool thread too.
    c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
    if (watched) {
      try {
        watched->raise_found();
      } catch (...) {
        future.setError(std::current_exception());
        return;
      }
    }
    // Completed on the launch stream: the future's events come after the op.
    c10::cuda::CUDAStreamGuard stream_guard(stream);
    future.markCompleted(c10::IValue(outputs));
  }

  static std::shared_ptr<Request> done_request() {
    auto r = std::make_shared<Request>();
    r->complete();
    return r;
  }

  std::vector<at::Tensor> outputs_;
  const int device_;
  const c10::cuda::CUDAStream stream_;
  const bool captured_;
  c10::intrusive_ptr<MooncakeWork> host_;
  std::mutex mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<WatchedOps> watched_;  // null: none
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
    // The caller's data, not an empty tensor: an op that writes only some
    // parts (a rooted op, or one that moves nothing) leaves the rest as it was.
    at::Tensor tmp = t.contiguous();
    stage_->results.emplace_back(t, tmp);
    return tmp;
  }
  // --- point-to-point device to device (p2p_buffers.h) ---
  // A send's bytes copied into `buf` on the staging stream (a send's ready()
  // waits for them before its note goes out).
  void copy_into(void* buf, const at::Tensor& t) {
    start();
    keep(t);
    const at::Tensor src = t.contiguous();  // (on the staging stream, which reuses it in order)
    cuda_check(cudaMemcpyAsync(buf, src.data_ptr(), t.nbytes(), cudaMemcpyDeviceToDevice,
                               b_.stream_->stream()),
               "copying a send into its point-to-point buffer");
  }
  // A recv into `t` whose host op brings a note: `land` copies the bytes it
  // names into `t` once the note is in (StagedOp::land).
  void land_with(const at::Tensor& t, std::function<void(cudaStream_t)> land) {
    start();
    keep(t);
    stage_->land = std::move(land);
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
      staged->wait();
    } else if (kind_ == MooncakeCudaBackend::Kind::kCollective) {
      b_.submit([staged] {
        // On the op queue's thread, while the caller may be capturing: an event
        // query in global mode there would end the capture in error.
        const RelaxedCapture relaxed;
        staged->wait();
      });
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
    const cudaStreamCaptureStatus capture = b_.capture_status();
    check_capture_intact(capture, op_);
    MC_CHECK_ARG(capture == cudaStreamCaptureStatusNone, op_,
                 ": cannot run under CUDA graph capture: of backend mooncake's ops, the "
                 "collectives its device-driven kernels serve can be captured (every rank on "
                 "one host: inputs up to MOONCAKE_CUDA_DIRECT_BYTES, all_reduce, reduce and "
                 "broadcast of any size, all_to_all with parts of one size); point-to-point "
                 "ops, barrier and other larger collectives cannot; call it outside the "
                 "captured region");
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

}  // namespace mooncake
