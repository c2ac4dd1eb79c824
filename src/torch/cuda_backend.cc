// MooncakeCudaBackend (cuda_backend.h): each op on the device collectives
// (device/collectives.h) where they serve it, else staged through host
// memory around mooncake-cpu's op (cuda_staging.h); all_reduce on the
// device-driven kernel where it serves it.
#if MOONCAKE_WITH_CUDA

#include "torch/cuda_backend.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "torch/cuda_staging.h"
#include "torch/tensor_args.h"

namespace mooncake {

namespace {

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> all;
  for (auto& l : lists) all.insert(all.end(), l.begin(), l.end());
  return all;
}

// The options mooncake-cpu's half gets: a CUDA active_ranks tensor is kept
// by the CUDA backend, which copies the host one into it on every change.
c10::intrusive_ptr<MooncakeBackendOptions> host_options(
    const c10::intrusive_ptr<MooncakeBackendOptions>& options) {
  if (!options || !options->active_ranks.defined() || options->active_ranks.is_cpu())
    return options;
  return options->with_mask(options->active_ranks.cpu());
}

// Whether an op's tensors include a CUDA one (then staging it moves GPU memory).
bool has_cuda(const at::Tensor& t) {
  return t.defined() && t.is_cuda();
}
bool has_cuda(const std::vector<at::Tensor>& ts) {
  return std::any_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return has_cuda(t); });
}
bool has_cuda(const std::vector<std::vector<at::Tensor>>& lists) {
  return std::any_of(lists.begin(), lists.end(),
                     [](const std::vector<at::Tensor>& l) { return has_cuda(l); });
}

const void* cptr(const at::Tensor& t) {
  return t.data_ptr();
}

std::vector<void*> ptrs(const std::vector<at::Tensor>& ts) {
  std::vector<void*> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(t.data_ptr());
  return out;
}

// The input of an op that writes `t` in place: `t` itself (contiguous) when the op fits
// the segment, else a copy, since an op that moves in pieces re-runs every piece from its
// input after a failure (DeviceCollectives::in_place_ok).
at::Tensor input_of(const DeviceCollectives& c, const at::Tensor& t) {
  return c.in_place_ok(t.nbytes()) ? t.contiguous() : t.clone(at::MemoryFormat::Contiguous);
}

// `n` pointers `bytes` apart from `base`: one tensor's per-rank slices.
std::vector<void*> slices(void* base, size_t bytes, size_t n) {
  std::vector<void*> out;
  for (size_t p = 0; p < n; ++p) out.push_back(static_cast<uint8_t*>(base) + p * bytes);
  return out;
}

}  // namespace

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
    if (auto o = DeviceCollectives::Options::from_env())
      coll_ = std::make_unique<DeviceCollectives>(comm(), MooncakeBackend::store(), prefix(),
                                                  device_, *o);
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
  // A rank the device-driven all_reduce masks shows as 0 there at once.
  if (coll_ && user_active_.defined() && user_active_.is_cuda())
    coll_->direct_report_to(user_active_.data_ptr<int32_t>());
  view_changed(MooncakeBackend::active_ranks());
}

at::Tensor MooncakeCudaBackend::active_ranks() const {
  return user_active_.defined() ? user_active_ : MooncakeBackend::active_ranks();
}

void MooncakeCudaBackend::view_changed(const at::Tensor& active) {
  if (device_ < 0) return;
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
  if (coll_) {
    // Ranks that left stop taking part in device-driven launches (graph
    // replays included) before the next setup.
    const int32_t* a = active.data_ptr<int32_t>();
    coll_->direct_view_changed(std::vector<uint8_t>(a, a + active.numel()), stream_->stream());
  }
  if (!user_active_.defined() || !user_active_.is_cuda()) return;
  // On the staging stream, so the ops' done events come after the update.
  c10::cuda::CUDAStreamGuard stream_guard(*stream_);
  user_active_.copy_(active);
}

template <typename Build>
c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::staged(const char* op, Kind kind,
                                                           Build&& build) {
  Staging staging(*this, op, kind);
  try {
    auto work = build(staging);
    if (kind == Kind::kCollective) queued(work);
    return work;
  } catch (const Error& e) {
    // Rejected by the staging (mooncake-cpu's own checks reject for themselves).
    if (!staging.handed_over() && kind == Kind::kCollective &&
        e.kind() == ErrorKind::kInvalidArgument && !shut_down())
      reject_next(e.what());
    throw;
  }
}

template <typename In, typename Out, typename HostOp>
c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::host_op(const char* op, c10d::OpType type,
                                                            std::vector<at::Tensor> results,
                                                            const In& in, const char* in_arg,
                                                            const Out& out, const char* out_arg,
                                                            HostOp&& call) {
  // Both sides: a gather's non-root ranks have no outputs, a scatter's no inputs.
  count_staged(has_cuda(results) || has_cuda(in));
  return staged(op, Kind::kCollective, [&](Staging& s) {
    auto host_in = s.in(in, in_arg);
    auto host_out = s.out(out, out_arg);
    return s.run(type, std::move(results), [&] { return call(host_out, host_in); });
  });
}

template <typename HostOp>
c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::host_inout(const char* op, c10d::OpType type,
                                                               std::vector<at::Tensor>& tensors,
                                                               const char* arg, HostOp&& call) {
  count_staged(has_cuda(tensors));
  return staged(op, Kind::kCollective, [&](Staging& s) {
    auto host = s.inout(tensors, arg);
    return s.run(type, tensors, [&] { return call(host); });
  });
}

// --- the device collectives -----------------------------------------------------------

bool MooncakeCudaBackend::on_plane(const std::vector<at::Tensor>& tensors,
                                   std::optional<size_t> bytes) {
  if (!coll_) return false;
  for (const at::Tensor& t : tensors)
    if (!t.defined() || !t.is_cuda() || t.device().index() != device_ ||
        t.layout() != at::kStrided || t.scalar_type() != tensors.begin()->scalar_type())
      return false;  // the staged path names what is wrong
  try {
    to_dtype(tensors.begin()->scalar_type(), "", "");
  } catch (const Error&) {
    return false;
  }
  return coll_->serves(bytes, timeout_ms());
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

bool MooncakeCudaBackend::on_plane_rooted(const at::Tensor& one,
                                          const std::vector<std::vector<at::Tensor>>& lists,
                                          int root) {
  if (root < 0 || root >= size_ || !one.defined()) return false;
  if (rank_ != root) return on_plane({one}, one.nbytes());
  return lists.size() == 1 && on_plane_list(one, lists[0], one.nbytes());
}

template <typename Move>
c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::on_device(Staging& s, c10d::OpType type,
                                                              std::vector<at::Tensor> results,
                                                              Move move) {
  ++device_ops_;
  return s.run_device(type, std::move(results), [this, move = std::move(move)] {
    c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
    c10::cuda::CUDAStreamGuard stream_guard(*stream_);
    move(*coll_, stream_->stream());
  });
}

// --- the device-driven all_reduce ----------------------------------------------------

bool MooncakeCudaBackend::direct_branch(const at::Tensor& t) {
  if (!coll_ || !t.defined() || !t.is_cuda() || t.layout() != at::kStrided) return false;
  try {
    to_dtype(t.scalar_type(), "", "");
  } catch (const Error&) {
    return false;
  }
  return coll_->direct_serves(t.nbytes(), timeout_ms());
}

void MooncakeCudaBackend::queued(const c10::intrusive_ptr<c10d::Work>& work) {
  last_stages_.clear();
  last_request_.reset();
  if (auto* w = dynamic_cast<MooncakeCudaWork*>(work.get())) {
    last_request_ = w->mooncake_work().request();
    last_stages_ = w->stages();
  } else if (auto* m = dynamic_cast<MooncakeWork*>(work.get())) {
    last_request_ = m->request();
  }
}

bool MooncakeCudaBackend::host_idle() const {
  if (last_request_ && !last_request_->done()) return false;
  for (const auto& s : last_stages_)
    if (!s->is_finished()) return false;
  return true;
}

void MooncakeCudaBackend::join_queued(cudaStream_t stream) {
  for (const auto& s : last_stages_) s->done->block(stream);
  last_stages_.clear();
  last_request_.reset();
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::direct_allreduce(
    const at::Tensor& t, const c10d::AllreduceOptions& opts) {
  const DType dt = to_dtype(t.scalar_type(), "all_reduce", "tensor");
  const RedOp op = to_redop(opts.reduceOp, t, "all_reduce");  // checks that dt defines it
  const int64_t timeout = op_timeout_ms(opts.timeout);
  const auto device = static_cast<c10::DeviceIndex>(device_);
  c10::cuda::CUDAGuard device_guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(caller.stream(), &capture), "cudaStreamIsCapturing");
  // A tensor on another GPU is this rank's mistake: it still takes part
  // (without data), so that every rank's launches stay in step, then raises.
  const std::string reject =
      t.device().index() == device_
          ? std::string()
          : str("all_reduce: tensor must be on cuda:", device_,
                " (the device that was current when the group was created), got ",
                t.device().str());
  const int slots = static_cast<int>(MooncakeBackend::active_ranks().numel());
  const bool captured = capture != cudaStreamCaptureStatusNone;
  if (captured) {
    MC_CHECK_ARG(reject.empty(), reject);
    MC_CHECK_ARG(!staging_coalesced_,
                 "all_reduce: cannot run under CUDA graph capture inside a coalescing block");
    MC_CHECK_ARG(host_idle() && coll_->direct_ready(),
                 "all_reduce under CUDA graph capture: the group's device-driven all_reduce is "
                 "not set up for its current members; call all_reduce once outside the "
                 "captured region first (after creating the group, and after any change of "
                 "its ranks), and wait for the group's earlier ops");
  }
  if (captured || (!staging_coalesced_ && host_idle() && coll_->direct_ready())) {
    if (captured) {
      // The queued op's copies are done: capture begins after a device synchronize.
      last_stages_.clear();
      last_request_.reset();
    } else {
      join_queued(caller.stream());  // after what the op queue put on the backend's stream
    }
    ++device_ops_;
    ++direct_ops_;
    if (!reject.empty()) {  // (eager only: a captured call raised above)
      coll_->direct_all_reduce(nullptr, nullptr, elems(t), dt, op, caller.stream(), timeout,
                               reject.c_str());
      throw_error(ErrorKind::kInvalidArgument, -1, reject);
    }
    const at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
    coll_->direct_all_reduce(buf.data_ptr(), buf.data_ptr(), elems(t), dt, op, caller.stream(),
                             timeout);
    if (!buf.is_same(t)) t.copy_(buf);
    return c10::make_intrusive<DeviceWork>(rank_, c10d::OpType::ALLREDUCE,
                                           std::vector<at::Tensor>{t}, device_, caller, captured,
                                           slots);
  }
  // In the op queue's order: its first call sets it up, with a host op.
  Staging s(*this, "all_reduce", Kind::kCollective);
  const at::Tensor out = reject.empty() ? s.device_out(t) : at::Tensor();
  auto work = on_device(
      s, c10d::OpType::ALLREDUCE, {t},
      [t, out, dt, op, timeout, reject](DeviceCollectives& c, cudaStream_t st) {
        if (!reject.empty()) {
          c.direct_all_reduce(nullptr, nullptr, elems(t), dt, op, st, timeout, reject.c_str());
          return;
        }
        const at::Tensor in = t.contiguous();
        c.direct_all_reduce(cptr(in), out.data_ptr(), elems(t), dt, op, st, timeout);
      });
  ++direct_ops_;
  queued(work);
  MC_CHECK_ARG(reject.empty(), reject);
  return work;
}

// --- the ops ----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  if (tensors.size() == 1 && root >= 0 && root < size_ &&
      on_plane({tensors[0]}, tensors[0].nbytes())) {
    return staged("broadcast", Kind::kCollective, [&](Staging& s) {
      const at::Tensor t = tensors[0];
      const DType dt = to_dtype(t.scalar_type(), "broadcast", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      // The root's tensor is only read; the others' are written (device_out keeps them too).
      const at::Tensor out = rank_ == root ? t : s.device_out(t);
      if (rank_ == root) s.keep(t);
      const bool is_root = rank_ == root;
      return on_device(s, c10d::OpType::BROADCAST, {t},
                       [t, out, dt, root, timeout, is_root](DeviceCollectives& c, cudaStream_t st) {
                         const at::Tensor in = is_root ? t.contiguous() : t;
                         c.broadcast(cptr(in), out.data_ptr(), elems(t), dt, root, st, timeout);
                       });
    });
  }
  return host_inout("broadcast", c10d::OpType::BROADCAST, tensors, "tensor",
                    [&](auto& host) { return MooncakeBackend::broadcast(host, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && direct_branch(tensors[0])) return direct_allreduce(tensors[0], opts);
  if (tensors.size() == 1 && on_plane({tensors[0]}, tensors[0].nbytes())) {
    return staged("all_reduce", Kind::kCollective, [&](Staging& s) {
      const at::Tensor t = tensors[0];
      const DType dt = to_dtype(t.scalar_type(), "all_reduce", "tensor");
      const RedOp op = to_redop(opts.reduceOp, t, "all_reduce");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      const at::Tensor out = s.device_out(t);
      return on_device(s, c10d::OpType::ALLREDUCE, {t},
                       [t, out, dt, op, timeout](DeviceCollectives& c, cudaStream_t st) {
                         const at::Tensor in = input_of(c, t);
                         c.all_reduce(cptr(in), out.data_ptr(), elems(t), dt, op, st, timeout);
                       });
    });
  }
  return host_inout("all_reduce", c10d::OpType::ALLREDUCE, tensors, "tensor",
                    [&](auto& host) { return MooncakeBackend::allreduce(host, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  size_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.defined() ? t.nbytes() : 0;
  if (!tensors.empty() && on_plane(tensors, bytes)) {
    // One device op per tensor, in order, on every rank: one Work.
    return staged("all_reduce_coalesced", Kind::kCollective, [&](Staging& s) {
      const RedOp op = to_redop(opts.reduceOp, tensors[0], "all_reduce_coalesced");
      const DType dt = to_dtype(tensors[0].scalar_type(), "all_reduce_coalesced", "tensors");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      std::vector<at::Tensor> outs;
      for (const at::Tensor& t : tensors) outs.push_back(s.device_out(t));
      return on_device(
          s, c10d::OpType::ALLREDUCE_COALESCED, tensors,
          [ts = tensors, outs, dt, op, timeout](DeviceCollectives& c, cudaStream_t st) {
            for (size_t i = 0; i < ts.size(); ++i) {
              const at::Tensor in = input_of(c, ts[i]);
              c.all_reduce(cptr(in), outs[i].data_ptr(), elems(ts[i]), dt, op, st, timeout);
            }
          });
    });
  }
  return host_inout("all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors, "tensors",
                    [&](auto& host) { return MooncakeBackend::allreduce_coalesced(host, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  if (tensors.size() == 1 && root >= 0 && root < size_ &&
      on_plane({tensors[0]}, tensors[0].nbytes())) {
    return staged("reduce", Kind::kCollective, [&](Staging& s) {
      const at::Tensor t = tensors[0];
      const DType dt = to_dtype(t.scalar_type(), "reduce", "tensor");
      const RedOp op = to_redop(opts.reduceOp, t, "reduce");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      // Only the root's tensor is written; the others' are read.
      const bool is_root = rank_ == root;
      const at::Tensor out = is_root ? s.device_out(t) : t;
      if (!is_root) s.keep(t);
      return on_device(
          s, c10d::OpType::REDUCE, {t},
          [t, out, dt, op, root, timeout, is_root](DeviceCollectives& c, cudaStream_t st) {
            const at::Tensor in = is_root ? input_of(c, t) : t.contiguous();
            c.reduce(cptr(in), is_root ? out.data_ptr() : nullptr, elems(t), dt, op, root, st,
                     timeout);
          });
    });
  }
  return host_inout("reduce", c10d::OpType::REDUCE, tensors, "tensor",
                    [&](auto& host) { return MooncakeBackend::reduce(host, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (inputs.size() == 1 && outputs.size() == 1 &&
      on_plane_list(inputs[0], outputs[0], inputs[0].nbytes())) {
    return staged("all_gather", Kind::kCollective, [&](Staging& s) {
      const at::Tensor in = inputs[0];
      const DType dt = to_dtype(in.scalar_type(), "all_gather", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      std::vector<at::Tensor> outs;
      for (const at::Tensor& t : outputs[0]) outs.push_back(s.device_out(t));
      return on_device(s, c10d::OpType::ALLGATHER, flat(outputs),
                       [in, outs, dt, timeout](DeviceCollectives& c, cudaStream_t st) {
                         const at::Tensor src = in.contiguous();
                         c.all_gather(cptr(src), elems(in), dt, ptrs(outs).data(), st, timeout);
                       });
    });
  }
  return host_op("all_gather", c10d::OpType::ALLGATHER, flat(outputs), inputs, "tensor", outputs,
                 "tensor_list", [&](auto& outs, auto& ins) {
                   return MooncakeBackend::allgather(outs, ins, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  if (output.defined() && input.defined() && output.numel() == input.numel() * size_ &&
      on_plane({input, output}, input.nbytes())) {
    return staged("all_gather_into_tensor", Kind::kCollective, [&](Staging& s) {
      const at::Tensor in = input;
      const DType dt = to_dtype(in.scalar_type(), "all_gather_into_tensor", "input_tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      const at::Tensor out = s.device_out(output);
      const auto world = static_cast<size_t>(size_);
      return on_device(s, c10d::OpType::_ALLGATHER_BASE, {output},
                       [in, out, dt, timeout, world](DeviceCollectives& c, cudaStream_t st) {
                         const at::Tensor src = in.contiguous();
                         const auto outs = slices(out.data_ptr(), in.nbytes(), world);
                         c.all_gather(cptr(src), elems(in), dt, outs.data(), st, timeout);
                       });
    });
  }
  return host_op("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {output}, input,
                 "input_tensor", output, "output_tensor", [&](auto& out, auto& in) {
                   return MooncakeBackend::_allgather_base(out, in, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  bool plane = !inputs.empty() && outputs.size() == inputs.size();
  for (size_t i = 0; plane && i < inputs.size(); ++i)
    plane = on_plane_list(inputs[i], outputs[i], inputs[i].nbytes());
  if (plane) {
    // One device op per input, in order, on every rank: one Work.
    return staged("all_gather_coalesced", Kind::kCollective, [&](Staging& s) {
      std::vector<DType> dts;
      std::vector<std::vector<at::Tensor>> outs(inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) {
        dts.push_back(
            to_dtype(inputs[i].scalar_type(), "all_gather_coalesced", "input_tensor_list"));
        s.keep(inputs[i]);
        for (const at::Tensor& t : outputs[i]) outs[i].push_back(s.device_out(t));
      }
      return on_device(s, c10d::OpType::ALLGATHER_COALESCED, flat(outputs),
                       [ins = inputs, outs, dts, timeout = op_timeout_ms(opts.timeout)](
                           DeviceCollectives& c, cudaStream_t st) {
                         for (size_t i = 0; i < ins.size(); ++i) {
                           const at::Tensor src = ins[i].contiguous();
                           c.all_gather(cptr(src), elems(ins[i]), dts[i], ptrs(outs[i]).data(), st,
                                        timeout);
                         }
                       });
    });
  }
  return host_op("all_gather_coalesced", c10d::OpType::ALLGATHER_COALESCED, flat(outputs), inputs,
                 "input_tensor_list", outputs, "output_tensor_lists", [&](auto& outs, auto& ins) {
                   return MooncakeBackend::allgather_coalesced(outs, ins, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  bool plane = !inputs.empty() && outputs.size() == inputs.size();
  for (size_t i = 0; plane && i < inputs.size(); ++i)
    plane = outputs[i].defined() && inputs[i].defined() &&
            outputs[i].numel() == inputs[i].numel() * size_ &&
            on_plane({inputs[i], outputs[i]}, inputs[i].nbytes());
  if (plane) {
    return staged("all_gather_into_tensor", Kind::kCollective, [&](Staging& s) {
      std::vector<DType> dts;
      std::vector<at::Tensor> outs;
      for (size_t i = 0; i < inputs.size(); ++i) {
        dts.push_back(to_dtype(inputs[i].scalar_type(), "all_gather_into_tensor", "input_tensor"));
        s.keep(inputs[i]);
        outs.push_back(s.device_out(outputs[i]));
      }
      return on_device(s, c10d::OpType::COALESCED, outputs,
                       [ins = inputs, outs, dts, timeout = op_timeout_ms(opts.timeout),
                        world = static_cast<size_t>(size_)](DeviceCollectives& c, cudaStream_t st) {
                         for (size_t i = 0; i < ins.size(); ++i) {
                           const at::Tensor src = ins[i].contiguous();
                           const auto to = slices(outs[i].data_ptr(), src.nbytes(), world);
                           c.all_gather(cptr(src), elems(src), dts[i], to.data(), st, timeout);
                         }
                       });
    });
  }
  return host_op("all_gather_into_tensor", c10d::OpType::COALESCED, outputs, inputs, "input_tensor",
                 outputs, "output_tensor", [&](auto& outs, auto& ins) {
                   return MooncakeBackend::allgather_into_tensor_coalesced(outs, ins, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  // The path depends on the input alone (what every rank shares): a root whose list does
  // not fit it is a bad call, which the staged path rejects on every rank.
  const int root = static_cast<int>(opts.rootRank);
  const bool is_root = rank_ == root;
  if (inputs.size() == 1 && on_plane_rooted(inputs[0], outputs, root)) {
    return staged("gather", Kind::kCollective, [&](Staging& s) {
      const at::Tensor in = inputs[0];
      const DType dt = to_dtype(in.scalar_type(), "gather", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      std::vector<at::Tensor> outs;
      if (is_root)
        for (const at::Tensor& t : outputs[0]) outs.push_back(s.device_out(t));
      return on_device(s, c10d::OpType::GATHER, flat(outputs),
                       [in, outs, dt, root, timeout](DeviceCollectives& c, cudaStream_t st) {
                         const at::Tensor src = in.contiguous();
                         const auto to = ptrs(outs);
                         c.gather(cptr(src), elems(in), dt, to.empty() ? nullptr : to.data(), root,
                                  st, timeout);
                       });
    });
  }
  return host_op("gather", c10d::OpType::GATHER, flat(outputs), inputs, "tensor", outputs,
                 "gather_list",
                 [&](auto& outs, auto& ins) { return MooncakeBackend::gather(outs, ins, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  // As gather: the path depends on the output alone.
  const int root = static_cast<int>(opts.rootRank);
  const bool is_root = rank_ == root;
  if (outputs.size() == 1 && on_plane_rooted(outputs[0], inputs, root)) {
    return staged("scatter", Kind::kCollective, [&](Staging& s) {
      const at::Tensor user_out = outputs[0];
      const DType dt = to_dtype(user_out.scalar_type(), "scatter", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      std::vector<at::Tensor> ins;
      if (is_root)
        for (const at::Tensor& t : inputs[0]) {
          s.keep(t);
          ins.push_back(t);
        }
      const at::Tensor out = s.device_out(user_out);
      return on_device(s, c10d::OpType::SCATTER, {user_out},
                       [ins, out, dt, root, timeout](DeviceCollectives& c, cudaStream_t st) {
                         std::vector<at::Tensor> srcs;  // kept until the op is done
                         std::vector<const void*> from;
                         for (const at::Tensor& t : ins) {
                           srcs.push_back(t.contiguous());
                           from.push_back(cptr(srcs.back()));
                         }
                         c.scatter(from.empty() ? nullptr : from.data(), out.data_ptr(), elems(out),
                                   dt, root, st, timeout);
                       });
    });
  }
  return host_op("scatter", c10d::OpType::SCATTER, outputs, inputs, "scatter_list", outputs,
                 "tensor",
                 [&](auto& outs, auto& ins) { return MooncakeBackend::scatter(outs, ins, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (inputs.size() == 1 && outputs.size() == 1 &&
      on_plane_list(outputs[0], inputs[0], outputs[0].nbytes() * inputs[0].size())) {
    return staged("reduce_scatter", Kind::kCollective, [&](Staging& s) {
      std::vector<at::Tensor> ins = inputs[0];
      const at::Tensor user_out = outputs[0];
      const DType dt = to_dtype(user_out.scalar_type(), "reduce_scatter", "output");
      const RedOp op = to_redop(opts.reduceOp, user_out, "reduce_scatter");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      for (const at::Tensor& t : ins) s.keep(t);
      const at::Tensor out = s.device_out(user_out);
      return on_device(s, c10d::OpType::REDUCE_SCATTER, {user_out},
                       [ins, out, dt, op, timeout](DeviceCollectives& c, cudaStream_t st) {
                         std::vector<at::Tensor> srcs;
                         for (const at::Tensor& t : ins) srcs.push_back(t.contiguous());
                         std::vector<const void*> from;
                         for (const at::Tensor& t : srcs) from.push_back(cptr(t));
                         c.reduce_scatter(from.data(), out.data_ptr(), elems(out), dt, op, st,
                                          timeout);
                       });
    });
  }
  return host_op("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs, inputs, "input_list",
                 outputs, "output", [&](auto& outs, auto& ins) {
                   return MooncakeBackend::reduce_scatter(outs, ins, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (output.defined() && input.defined() && input.numel() == output.numel() * size_ &&
      on_plane({input, output}, input.nbytes())) {
    return staged("reduce_scatter_tensor", Kind::kCollective, [&](Staging& s) {
      const at::Tensor in = input;
      const DType dt = to_dtype(in.scalar_type(), "reduce_scatter_tensor", "input");
      const RedOp op = to_redop(opts.reduceOp, in, "reduce_scatter_tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      const at::Tensor out = s.device_out(output);
      const auto world = static_cast<size_t>(size_);
      return on_device(s, c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                       [in, out, dt, op, timeout, world](DeviceCollectives& c, cudaStream_t st) {
                         const at::Tensor src = in.contiguous();
                         const auto parts = slices(src.data_ptr(), out.nbytes(), world);
                         std::vector<const void*> from(parts.begin(), parts.end());
                         c.reduce_scatter(from.data(), out.data_ptr(), elems(out), dt, op, st,
                                          timeout);
                       });
    });
  }
  return host_op("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {output}, input,
                 "input", output, "output", [&](auto& out, auto& in) {
                   return MooncakeBackend::_reduce_scatter_base(out, in, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  bool plane = !inputs.empty() && outputs.size() == inputs.size();
  for (size_t i = 0; plane && i < inputs.size(); ++i)
    plane = outputs[i].defined() && inputs[i].defined() &&
            inputs[i].numel() == outputs[i].numel() * size_ &&
            on_plane({inputs[i], outputs[i]}, inputs[i].nbytes());
  if (plane) {
    return staged("reduce_scatter_tensor", Kind::kCollective, [&](Staging& s) {
      std::vector<DType> dts;
      std::vector<RedOp> ops;
      std::vector<at::Tensor> outs;
      for (size_t i = 0; i < inputs.size(); ++i) {
        dts.push_back(to_dtype(inputs[i].scalar_type(), "reduce_scatter_tensor", "input"));
        ops.push_back(to_redop(opts.reduceOp, inputs[i], "reduce_scatter_tensor"));
        s.keep(inputs[i]);
        outs.push_back(s.device_out(outputs[i]));
      }
      return on_device(s, c10d::OpType::COALESCED, outputs,
                       [ins = inputs, outs, dts, ops, timeout = op_timeout_ms(opts.timeout),
                        world = static_cast<size_t>(size_)](DeviceCollectives& c, cudaStream_t st) {
                         for (size_t i = 0; i < ins.size(); ++i) {
                           const at::Tensor src = ins[i].contiguous();
                           const auto parts = slices(src.data_ptr(), outs[i].nbytes(), world);
                           std::vector<const void*> from(parts.begin(), parts.end());
                           c.reduce_scatter(from.data(), outs[i].data_ptr(), elems(outs[i]), dts[i],
                                            ops[i], st, timeout);
                         }
                       });
    });
  }
  return host_op("reduce_scatter_tensor", c10d::OpType::COALESCED, outputs, inputs, "input",
                 outputs, "output", [&](auto& outs, auto& ins) {
                   return MooncakeBackend::reduce_scatter_tensor_coalesced(outs, ins, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::all_to_all_on_device(
    Staging& s, const char* op, c10d::OpType type, const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs, std::vector<size_t> in_counts,
    std::vector<size_t> out_counts, int64_t timeout) {
  DeviceCollectives::check_own_counts(rank_, in_counts.data(), out_counts.data(), op);
  const DType dt = to_dtype(inputs[0].scalar_type(), op, "input");
  for (const at::Tensor& t : inputs) s.keep(t);
  std::vector<at::Tensor> outs;
  for (const at::Tensor& t : outputs) outs.push_back(s.device_out(t));
  return on_device(
      s, type, outputs,
      [inputs, outs, in_counts, out_counts, dt, timeout, world = size_](DeviceCollectives& c,
                                                                        cudaStream_t st) {
        std::vector<at::Tensor> ins;  // kept until the op is done
        for (const at::Tensor& t : inputs) ins.push_back(t.contiguous());
        std::vector<const void*> src;
        std::vector<void*> dst = ptrs(outs);
        for (const at::Tensor& t : ins) src.push_back(cptr(t));
        if (ins.size() == 1) {  // all_to_all_single: slices of one tensor each
          const size_t esize = dtype_size(dt);
          src.resize(static_cast<size_t>(world));
          dst.resize(static_cast<size_t>(world));
          for (size_t p = 1; p < src.size(); ++p) {
            src[p] = static_cast<const uint8_t*>(src[p - 1]) + in_counts[p - 1] * esize;
            dst[p] = static_cast<uint8_t*>(dst[p - 1]) + out_counts[p - 1] * esize;
          }
        }
        c.all_to_all(src.data(), in_counts.data(), dst.data(), out_counts.data(), dt, st, timeout);
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
      return all_to_all_on_device(
          s, "all_to_all_single", c10d::OpType::ALLTOALL_BASE, {input}, {output},
          split_counts(input, input_split_sizes, size_, "input_split_sizes", "input"),
          split_counts(output, output_split_sizes, size_, "output_split_sizes", "output"),
          op_timeout_ms(opts.timeout));
    });
  }
  return host_op("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {output}, input, "input", output,
                 "output", [&](auto& out, auto& in) {
                   return MooncakeBackend::alltoall_base(out, in, output_split_sizes,
                                                         input_split_sizes, opts);
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
      return all_to_all_on_device(s, "all_to_all", c10d::OpType::ALLTOALL, inputs, outputs,
                                  std::move(in_counts), std::move(out_counts),
                                  op_timeout_ms(opts.timeout));
    });
  }
  return host_op("all_to_all", c10d::OpType::ALLTOALL, outputs, inputs, "input_tensor_list",
                 outputs, "output_tensor_list",
                 [&](auto& outs, auto& ins) { return MooncakeBackend::alltoall(outs, ins, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::barrier(const c10d::BarrierOptions& opts) {
  return staged("barrier", Kind::kCollective, [&](Staging& s) {
    s.order_after_stream();
    return s.run(c10d::OpType::BARRIER, {}, [&] { return MooncakeBackend::barrier(opts); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::send(std::vector<at::Tensor>& tensors, int dst,
                                                         int tag) {
  count_staged(has_cuda(tensors));
  return staged("send", Kind::kSend, [&](Staging& s) {
    auto host = s.in(tensors, "tensor");
    return s.run(c10d::OpType::SEND, tensors,
                 [&] { return MooncakeBackend::send(host, dst, tag); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::recv(std::vector<at::Tensor>& tensors, int src,
                                                         int tag) {
  count_staged(has_cuda(tensors));
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
