// MooncakeCudaBackend (cuda_backend.h): each collective on the device-driven
// kernels (device/direct_ops.h) where they serve it, else on the device
// collectives (device/collectives.h) where they serve it, else staged through
// host memory around mooncake-cpu's op (cuda_staging.h).
#if MOONCAKE_WITH_CUDA

#include "torch/cuda_backend.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/env.h"
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

// The size an op's plane branch is decided on: none (any size takes the
// plane) for an op the device-driven kernels serve but that takes them under
// capture only (`warm`): its eager call then sets them up, on the plane,
// whatever its size (the staged path below MOONCAKE_CUDA_PLANE_MIN_BYTES
// could not).
std::optional<size_t> plane_bytes(const std::optional<DirectOps::Op>& warm, size_t bytes) {
  return warm ? std::nullopt : std::optional<size_t>(bytes);
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
    const int64_t p2p_bytes = env_int("MOONCAKE_CUDA_P2P_BYTES");
    MC_CHECK_ARG(p2p_bytes >= 0, "MOONCAKE_CUDA_P2P_BYTES must be >= 0, got ", p2p_bytes);
    if (coll_ && p2p_bytes > 0) {
      p2p_bytes_ = static_cast<size_t>(p2p_bytes);
      p2p_buffers_ = std::make_shared<P2PBuffers>(device_);
    }
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
  // A rank the device-driven kernels mask shows as 0 there at once.
  if (coll_ && user_active_.defined() && user_active_.is_cuda())
    coll_->direct_report_to(user_active_.data_ptr<int32_t>());
  view_changed(MooncakeBackend::active_ranks());
}

MooncakeCudaBackend::~MooncakeCudaBackend() {
  close_acks();
}

void MooncakeCudaBackend::shutdown() {
  close_acks();  // before the channel goes
  MooncakeBackend::shutdown();
}

at::Tensor MooncakeCudaBackend::active_ranks() const {
  return user_active_.defined() ? user_active_ : MooncakeBackend::active_ranks();
}

void MooncakeCudaBackend::view_changed(const at::Tensor& active) {
  if (device_ < 0) return;
  const RelaxedCapture relaxed;  // the view listener's thread, while the caller may capture
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
                                          int root, bool any_size) {
  if (root < 0 || root >= size_ || !one.defined()) return false;
  const std::optional<size_t> bytes = any_size ? std::nullopt : std::optional<size_t>(one.nbytes());
  if (rank_ != root) return on_plane({one}, bytes);
  return lists.size() == 1 && on_plane_list(one, lists[0], bytes);
}

template <typename Move>
c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::on_device(Staging& s, c10d::OpType type,
                                                              std::vector<at::Tensor> results,
                                                              Move move,
                                                              std::optional<DirectOps::Op> warm) {
  ++device_ops_;
  return s.run_device(type, std::move(results), [this, move = std::move(move), warm] {
    const RelaxedCapture relaxed;  // on the op queue: the caller may be capturing
    c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_));
    c10::cuda::CUDAStreamGuard stream_guard(*stream_);
    if (warm) coll_->direct_prepare(*warm, stream_->stream());
    move(*coll_, stream_->stream());
  });
}

// --- the device-driven ops ----------------------------------------------------------
//
// all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
// all_to_all_single without split sizes, and their coalesced forms take them
// whenever they serve the op: their results where a rank fails are the host
// path's (the survivors' reduction, zeros in a lost rank's parts), except
// that a rank whose input was in place before it died is counted in. The rooted
// ops (broadcast, reduce, gather, scatter) and the list forms of all_gather
// and reduce_scatter take them too, watched: each eager launch leaves what it
// found in a slot, and the Work's wait() (which torch calls itself unless
// async_op) raises it as the plane would: PeerFailedError where the root's
// input never came (a launch can only zero-fill what the root would have
// sent), ValueError where another rank's call was bad or another op (each
// rank's launch leaves that rank out). all_gather_coalesced, all_to_all's
// list form and all_to_all_single with split sizes take them under CUDA graph
// capture only (eagerly the ranks' parts may differ): eagerly they take the
// device plane, whose call sets the kernels up first, so that it readies
// their capture. A group of one rank takes every op the kernels could serve
// through them, eagerly too and at any size: a local copy on the caller's
// stream (nothing at all in place).

namespace {

using kernels::DirectKind;

// The call's output tensor, or a list form's outputs (one per part): every
// part of it, contiguous (a copy where the user's is not, or for a list).
at::Tensor contiguous_out(const DirectCall& call) {
  if (call.out.defined())
    return call.out.is_contiguous() ? call.out : at::empty(call.out.sizes(), call.out.options());
  if (call.outs.empty()) return {};
  return at::empty({static_cast<int64_t>(call.outs.size()) * call.outs[0].numel()},
                   call.outs[0].options());
}

// Each of `outs` from its part of `flat` (parts in order, each one output's size).
void copy_parts(const at::Tensor& flat, const std::vector<at::Tensor>& outs) {
  for (size_t p = 0; p < outs.size(); ++p) {
    const int64_t n = outs[p].numel();
    outs[p].copy_(flat.narrow(0, static_cast<int64_t>(p) * n, n).view(outs[p].sizes()));
  }
}

// `op` as launches of at most `chunk` elements of each part (0: one launch),
// each the same offset into every part of the input and the output, every
// rank cutting alike. (Chunks come under capture only, where a rejected call
// raises before it launches anything, as an unchunked one does.)
void launch_pieces(DeviceCollectives& c, const DirectOps::Op& op, size_t chunk, cudaStream_t stream,
                   int64_t timeout, const char* reject, bool queued) {
  if (chunk == 0 || op.count <= chunk) {
    c.direct(op, stream, timeout, reject, queued);
    return;
  }
  const size_t esize = dtype_size(op.dtype);
  for (size_t first = 0; first < op.count; first += chunk) {
    DirectOps::Op piece = op;
    piece.count = std::min(chunk, op.count - first);
    // Of every part of a multi-part input or output, the same piece: the
    // pointers below are part 0's, the others a whole part further each.
    piece.stride = op.part_stride();
    if (op.in != nullptr) piece.in = static_cast<const uint8_t*>(op.in) + first * esize;
    if (op.out != nullptr) piece.out = static_cast<uint8_t*>(op.out) + first * esize;
    for (void*& p : piece.parts) p = static_cast<uint8_t*>(p) + first * esize;
    c.direct(piece, stream, timeout, reject, queued);
  }
}

bool all_contiguous(const std::vector<at::Tensor>& ts) {
  return std::all_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return t.is_contiguous(); });
}

// Every tensor of `list` flattened into one, in order (a list form's input).
at::Tensor cat_flat(const std::vector<at::Tensor>& list) {
  // One tensor (a world of one): itself, flat, not a copy (launches only read it).
  if (list.size() == 1) return list[0].reshape({-1});
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : list) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// An all_to_all with per-pair sizes (DirectOps::Op::vary): every part at its
// own address and contiguous (a copy where the caller's is not, an output's
// copied back after the launch), an input that shares memory with an output
// copied first (a later round reads the input after an earlier one wrote the
// outputs). all_to_all_single's parts are slices of `in` and `out`.
void run_vary(DeviceCollectives& c, const DirectCall& call, cudaStream_t stream, int64_t timeout,
              bool queued, bool alone) {
  DirectOps::Op op = call.op;
  // What the launch reads and writes, kept until it is queued (the allocator
  // orders a later reuse after it on the stream).
  at::Tensor in, whole;  // all_to_all_single's input and output, contiguous
  std::vector<at::Tensor> ins, outs;
  const auto part = [](const at::Tensor& t) { return t.numel() > 0 ? t.data_ptr() : nullptr; };
  if (call.in.defined()) {
    // Each part's address from its offset (no view per part: a host cost per rank).
    in = call.in.contiguous();
    if (in.storage().is_alias_of(call.out.storage())) in = in.clone();
    // (A copy of the user's output, not an empty one: an op that moves nothing,
    // sizes that disagree, leaves it as it was.)
    whole = call.out.contiguous();
    size_t a = 0, b = 0;
    for (size_t p = 0; p < op.send_bytes.size(); ++p) {
      op.in_parts.push_back(op.send_bytes[p] > 0 ? static_cast<uint8_t*>(in.data_ptr()) + a
                                                 : nullptr);
      op.parts.push_back(op.recv_bytes[p] > 0 ? static_cast<uint8_t*>(whole.data_ptr()) + b
                                              : nullptr);
      a += op.send_bytes[p];
      b += op.recv_bytes[p];
    }
  } else {
    for (const at::Tensor& t : call.outs) {
      outs.push_back(t.contiguous());
      op.parts.push_back(part(outs.back()));
    }
    for (const at::Tensor& t : call.ins) {
      at::Tensor one = t.contiguous();
      for (const at::Tensor& o : outs)
        if (one.storage().is_alias_of(o.storage())) {
          one = one.clone();
          break;
        }
      ins.push_back(one);
      op.in_parts.push_back(part(one));
    }
  }
  if (alone) {
    // A group of one: its own part, a local copy.
    if (op.send_bytes[0] > 0)
      cuda_check(cudaMemcpyAsync(op.parts[0], op.in_parts[0], op.send_bytes[0],
                                 cudaMemcpyDeviceToDevice, stream),
                 "all_to_all: a lone rank's part");
  } else {
    c.direct(op, stream, timeout, nullptr, queued);
  }
  if (call.in.defined()) {
    if (!whole.is_same(call.out)) call.out.copy_(whole);
  } else {
    for (size_t p = 0; p < outs.size(); ++p)
      if (!outs[p].is_same(call.outs[p])) call.outs[p].copy_(outs[p]);
  }
}

// Queues `call` on `stream` (the current one) and, on it, the copies of its
// results into the user's tensors where they were not the kernel's output.
// `queued`: by the op queue (DeviceCollectives::direct's `queued`). `alone`:
// the group has one rank, where every op is the identity: no kernel, a copy
// where the output is not the input (by the op queue only past the kernels'
// bound, after direct_prepare; below it the queue's call sets them up).
void run_direct(DeviceCollectives& c, const DirectCall& call, cudaStream_t stream, int64_t timeout,
                bool queued, bool alone = false) {
  DirectOps::Op op = call.op;
  if (op.mapped && !call.reject.empty()) {
    c.mapped_all_reduce(nullptr, op.count, op.dtype, op.op, stream, timeout, queued,
                        call.reject.c_str());
    return;
  }
  if (!call.reject.empty()) {
    if (!alone) launch_pieces(c, op, call.chunk, stream, timeout, call.reject.c_str(), queued);
    return;
  }
  if (op.vary) {
    run_vary(c, call, stream, timeout, queued, alone);
    return;
  }
  // A list the kernel reads or writes at its tensors' own addresses (no copy
  // through one flat tensor), where the op is one launch and every tensor of
  // the list is contiguous; one side only.
  const bool whole = !alone && call.chunk == 0;
  const bool list_in = whole && !call.ins.empty() && all_contiguous(call.ins);
  const bool list_out = whole && !list_in && !call.outs.empty() && all_contiguous(call.outs);
  const at::Tensor given = call.ins.empty() || list_in ? call.in : cat_flat(call.ins);
  if (alone && !call.out.defined() && given.defined() && !call.outs.empty() &&
      given.numel() == static_cast<int64_t>(call.outs.size()) * call.outs[0].numel()) {
    // A list form alone: each output straight from its part of the input, not
    // through a contiguous copy of them all.
    copy_parts(given.reshape({-1}), call.outs);
    return;
  }
  const at::Tensor out = list_out ? at::Tensor() : contiguous_out(call);
  // In place (all_reduce, a root's broadcast or reduce): one buffer is both.
  const bool same = given.defined() && call.out.defined() && given.is_same(call.out);
  if (same && !out.is_same(call.out)) out.copy_(given);
  const at::Tensor in = !given.defined() ? at::Tensor() : same ? out : given.contiguous();
  op.in = in.defined() ? in.data_ptr() : nullptr;
  op.out = out.defined() ? out.data_ptr() : nullptr;
  if (op.mapped && op.in != op.out) {
    // In place only (the op queue's staging may hand a copy of the output).
    out.copy_(in);
    op.in = op.out;
  }
  if (list_in) {
    op.list = kernels::DirectList::kIn;
    op.parts = ptrs(call.ins);
  } else if (list_out) {
    op.list = kernels::DirectList::kOut;
    op.parts = ptrs(call.outs);
  }
  std::exception_ptr left;  // raised once the result is copied back
  if (op.mapped) {
    bool served = true;
    try {
      served = c.mapped_all_reduce(op.out, op.count, op.dtype, op.op, stream, timeout, queued);
    } catch (const Error& e) {
      // An earlier launch left this rank out: this one is queued (the copies
      // below must follow it); a timeout of the setup left `out` as it was.
      if (e.kind() != ErrorKind::kTimeout) throw;
      left = std::current_exception();
    }
    if (!served) {
      // The kernels cannot serve the view: the plane, whose inputs must differ
      // from its output past a segment (a failure re-runs its pieces).
      const at::Tensor src = input_of(c, out);
      c.all_reduce(src.data_ptr(), op.out, op.count, op.dtype, op.op, stream, timeout);
    }
  } else if (alone) {
    if (op.in != nullptr && op.out != nullptr && op.in != op.out)
      cuda_check(
          cudaMemcpyAsync(op.out, op.in, static_cast<size_t>(op.count) * dtype_size(op.dtype),
                          cudaMemcpyDeviceToDevice, stream),
          "copying a one-rank collective's input");
  } else {
    launch_pieces(c, op, call.chunk, stream, timeout, nullptr, queued);
  }
  if (call.out.defined() && !out.is_same(call.out)) call.out.copy_(out);
  if (!list_out) copy_parts(out, call.outs);
  if (left) std::rethrow_exception(left);
}

// The rejection of an op some of whose CUDA tensors are not on `device`.
std::string wrong_device(const char* name, const char* arg, int device,
                         const std::vector<at::Tensor>& ts) {
  for (const at::Tensor& t : ts)
    if (t.defined() && (!t.is_cuda() || t.device().index() != device))
      return str(name, ": ", arg, " must be on cuda:", device,
                 " (the device that was current when the group was created), got ",
                 t.device().str());
  return {};
}

// The rejection of a call whose `arg` (the tensor only this rank holds) does
// not hold `want` elements of `like`'s dtype (the tensor every rank holds,
// which chose the path): "" where it does. Every rank takes the path the
// shared tensor chose, so a bad call takes part without data and raises,
// rather than take another path and leave the others waiting.
std::string misfit(const char* name, const char* arg, const at::Tensor& t, int64_t want,
                   const at::Tensor& like) {
  if (t.defined() && t.layout() == at::kStrided && t.numel() == want &&
      t.scalar_type() == like.scalar_type())
    return {};
  if (!t.defined()) return str(name, ": ", arg, " is undefined");
  return str(name, ": ", arg, " must hold ", want, " elements of ", dtype_str(like.scalar_type()),
             ", got ", t.numel(), " of ", dtype_str(t.scalar_type()));
}

// Whether all_to_all_single's `splits` (rows of `t`) are `world` equal parts
// of t, or none.
bool equal_splits(const at::Tensor& t, const std::vector<int64_t>& splits, int world) {
  if (splits.empty()) return true;
  if (splits.size() != static_cast<size_t>(world) || t.dim() == 0) return false;
  return std::all_of(splits.begin(), splits.end(),
                     [&](int64_t rows) { return rows * world == t.size(0); });
}

// Whether `list` holds `n` tensors of `numel` elements each, of `like`'s dtype.
bool list_fits(const std::vector<at::Tensor>& list, size_t n, const at::Tensor& like) {
  if (list.size() != n) return false;
  for (const at::Tensor& t : list)
    if (!t.defined() || t.layout() != at::kStrided || t.numel() != like.numel() ||
        t.scalar_type() != like.scalar_type())
      return false;
  return true;
}

// A rooted op's list at its root (gather's outputs, scatter's inputs): the
// rejection where it is not one list of `world` tensors shaped as `one` (the
// tensor every rank holds, named `one_arg`), else "" with its tensors added
// to `all`.
std::string root_list(const char* name, const char* arg,
                      const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& one,
                      const char* one_arg, int world, std::vector<at::Tensor>& all) {
  if (lists.size() != 1 || !list_fits(lists[0], static_cast<size_t>(world), one))
    return str(name, ": ", arg, " must hold ", world, " tensors (the world size) of ", one.numel(),
               " elements of ", dtype_str(one.scalar_type()), " each (as the ", one_arg, ")");
  all.insert(all.end(), lists[0].begin(), lists[0].end());
  return {};
}

DirectOps::Op direct_op(DirectKind kind, size_t count, int root = 0, RedOp red = RedOp::kSum) {
  DirectOps::Op op;
  op.kind = kind;
  op.count = count;
  op.root = root;
  op.op = red;
  return op;
}

// Leases `call` a slot for its launch's outcome (`name`: the op's), kept in `watched`.
void watch(DeviceCollectives& c, DirectCall& call, const char* name,
           std::vector<WatchedLaunch>& watched) {
  DirectOutcomes::Lease lease = c.direct_watch();
  call.op.outcome = lease.device();
  call.op.ticket = lease.ticket();
  const int root = kernels::direct_rooted(call.op.kind) ? call.op.root : -1;
  watched.push_back({std::move(lease), name, root, !call.reject.empty()});
}

}  // namespace

bool MooncakeCudaBackend::direct_branch(DirectOps::Op& op, const at::Tensor& t) {
  if (!coll_ || !t.defined() || !t.is_cuda() || t.layout() != at::kStrided) return false;
  try {
    op.dtype = to_dtype(t.scalar_type(), "", "");
  } catch (const Error&) {
    return false;
  }
  // Alone, an op of any size is a local copy (run_direct's `alone`).
  return coll_->direct_serves(op, timeout_ms()) || alone();
}

size_t MooncakeCudaBackend::capture_chunk(DirectOps::Op& op, const at::Tensor& t) {
  if (!capturing() || alone()) return 0;  // (alone any size is served whole)
  DirectOps::Op one = op;
  one.count = 1;
  if (!direct_branch(one, t)) return 0;
  op.dtype = one.dtype;
  return coll_->direct_chunk(op);
}

std::optional<DirectOps::Op> MooncakeCudaBackend::one_element(DirectOps::Op op,
                                                              const at::Tensor& t) {
  if (op.count <= 1) return std::nullopt;  // (then the op itself was the question)
  op.count = 1;
  if (!direct_branch(op, t)) return std::nullopt;
  return op;
}

MooncakeCudaBackend::DirectPlan MooncakeCudaBackend::plan_direct(DirectOps::Op& op,
                                                                 const at::Tensor& t) {
  DirectPlan plan;
  if (direct_branch(op, t)) plan.warm = op;
  plan.setup = plan.warm ? plan.warm : one_element(op, t);
  plan.chunk = plan.warm ? 0 : capture_chunk(op, t);
  return plan;
}

bool MooncakeCudaBackend::alone() {
  // (A world of one with spare slots is not: a rank that joins past the world
  // size takes part in its ops, through the plane or staging.)
  return size_ == 1 && coll_ && coll_->direct_alone(timeout_ms());
}

bool MooncakeCudaBackend::direct_now() {
  // recovers() first: in the default mode no stream query on the hot path
  // (direct_run asks capturing() itself). Alone, no failure to recover from.
  return coll_->recovers() || alone() || capturing();
}

bool MooncakeCudaBackend::rooted_now() {
  // Alone, no root can fail and no other rank's list differs: eagerly too.
  return alone() || capturing();
}

bool MooncakeCudaBackend::checked_now(bool lists) {
  // (The spare slots are fixed when the group is made, alike at every rank;
  // extend_group_size_to is each rank's own call.)
  return coll_ && direct_now() && !(lists && comm().capacity() > size_);
}

bool MooncakeCudaBackend::settle_watched() {
  bool lost = false;
  for (const std::shared_ptr<WatchedOps>& w : watched_) {
    w->check();
    lost = lost || w->lost;
  }
  watched_.clear();
  return lost;
}

bool MooncakeCudaBackend::capturing() const {
  return capture_status() != cudaStreamCaptureStatusNone;
}

cudaStreamCaptureStatus MooncakeCudaBackend::capture_status() const {
  if (device_ < 0) return cudaStreamCaptureStatusNone;
  const auto caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(caller.stream(), &capture), "cudaStreamIsCapturing");
  return capture;
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

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::direct_run(const char* name, c10d::OpType type,
                                                               std::vector<DirectCall> calls,
                                                               std::vector<at::Tensor> results,
                                                               int64_t timeout) {
  const auto device = static_cast<c10::DeviceIndex>(device_);
  c10::cuda::CUDAGuard device_guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  const cudaStreamCaptureStatus capture = capture_status();
  const bool captured = capture != cudaStreamCaptureStatusNone;
  std::string reject;  // the first call's rejection, raised once every call took part
  for (const DirectCall& c : calls)
    if (reject.empty()) reject = c.reject;
  const int slots = static_cast<int>(MooncakeBackend::active_ranks().numel());
  // A watched launch since the last such op masked a member: this op sets the
  // kernels up again on the op queue, which has the survivors agree on their
  // view (under capture it waits for the next eager op).
  bool resync = !captured && settle_watched();
  // The op queue is idle (else it may be polling itself): what finished
  // launches reported counts before deciding, so that a launch here needs no
  // host op. (Where it is not, this op goes on it, and takes a resync a queued
  // op left there.)
  const bool idle = host_idle();
  if (idle) coll_->direct_poll();
  if (!captured && idle && resync_pending_.exchange(false)) resync = true;
  const bool ready = idle && !resync && coll_->direct_ready();
  if (captured) {
    // Asked again, after the queries above: an error below must not hide a
    // capture that broke meanwhile (its end would fail whatever we raise).
    check_capture_intact(capture_status(), name);
    MC_CHECK_ARG(reject.empty(), reject);
    MC_CHECK_ARG(!staging_coalesced_, name,
                 ": cannot run under CUDA graph capture inside a coalescing block");
    MC_CHECK_ARG(ready, name,
                 " under CUDA graph capture: the group's device-driven kernels are not set up "
                 "for its current members; run one collective on the group (e.g. all_reduce) "
                 "outside the captured region first (after creating the group, and after any "
                 "change of its ranks), and wait for the group's earlier ops");
  }
  if (captured || (!staging_coalesced_ && ready)) {
    if (captured) {
      // The queued op's copies are done: capture begins after a device synchronize.
      last_stages_.clear();
      last_request_.reset();
    } else {
      join_queued(caller.stream());  // after what the op queue put on the backend's stream
    }
    ++device_ops_;
    direct_ops_ += static_cast<int64_t>(calls.size());
    // A rejected call is watched too: what it saw of the others counts for
    // the view as theirs does.
    std::vector<WatchedLaunch> watched;
    for (DirectCall& c : calls) {
      if (c.watch && !captured && size_ > 1) watch(*coll_, c, name, watched);
      run_direct(*coll_, c, caller.stream(), timeout, false, size_ == 1);
    }
    std::shared_ptr<WatchedOps> ops;
    if (!watched.empty()) {
      ops = std::make_shared<WatchedOps>(std::move(watched), rank_, coll_->direct_members(),
                                         caller.stream());
      watched_.push_back(ops);
    }
    MC_CHECK_ARG(reject.empty(), reject);
    return c10::make_intrusive<DeviceWork>(rank_, type, std::move(results), device_, caller,
                                           captured, slots, std::move(ops));
  }
  // In the op queue's order: its first call sets the kernels up, with a host op.
  Staging s(*this, name, Kind::kCollective);
  for (DirectCall& c : calls) {
    if (!c.reject.empty()) continue;  // its tensors are not touched
    if (c.in.defined()) s.keep(c.in);
    for (const at::Tensor& t : c.ins) s.keep(t);
    if (c.out.defined()) c.out = s.device_out(c.out);
    for (at::Tensor& t : c.outs) t = s.device_out(t);
  }
  const auto n = static_cast<int64_t>(calls.size());
  const bool checked = size_ > 1;
  auto work = on_device(s, type, std::move(results),
                        [this, calls = std::move(calls), timeout, checked, name, resync,
                         me = rank_](DeviceCollectives& c, cudaStream_t st) {
                          // This op's own resync, or one a queued op before it left.
                          const bool pending = resync_pending_.exchange(false);
                          if (resync || pending) c.direct_resync();
                          std::vector<WatchedLaunch> watched;
                          for (DirectCall call : calls) {
                            // Alone past the kernels' bound: set up for the next calls, then a
                            // local copy.
                            const bool alone =
                                c.direct_alone(timeout) && !c.direct_serves(call.op, timeout);
                            if (alone) c.direct_prepare(call.op, st, timeout);
                            if (call.watch && checked && !alone) watch(c, call, name, watched);
                            run_direct(c, call, st, timeout, true, alone);
                          }
                          if (watched.empty()) return;
                          // The Work raises what the launches found, as the plane's would; a
                          // member lost sets the next op up again, here in the queue's order.
                          WatchedOps ops(std::move(watched), me, c.direct_members(), st);
                          ops.check();
                          if (ops.lost) resync_pending_ = true;
                          ops.raise_found();
                        });
  direct_ops_ += n;
  queued(work);
  MC_CHECK_ARG(reject.empty(), reject);
  return work;
}

// --- the ops ----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  DirectPlan plan;
  if (tensors.size() == 1 && root >= 0 && root < size_) {
    const at::Tensor& t = tensors[0];
    DirectOps::Op op = direct_op(DirectKind::kBroadcast, elems(t), root);
    plan = plan_direct(op, t);
    if ((plan.warm && checked_now(false)) || plan.chunk > 0) {
      DirectCall call{op,
                      rank_ == root ? t : at::Tensor(),
                      t,
                      {},
                      wrong_device("broadcast", "tensor", device_, {t}),
                      plan.chunk,
                      true};
      return direct_run("broadcast", c10d::OpType::BROADCAST, {std::move(call)}, {t},
                        op_timeout_ms(opts.timeout));
    }
  }
  if (tensors.size() == 1 && root >= 0 && root < size_ &&
      on_plane({tensors[0]}, plane_bytes(plan.warm, tensors[0].nbytes()))) {
    return staged("broadcast", Kind::kCollective, [&](Staging& s) {
      const at::Tensor t = tensors[0];
      const DType dt = to_dtype(t.scalar_type(), "broadcast", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      // The root's tensor is only read; the others' are written (device_out keeps them too).
      const at::Tensor out = rank_ == root ? t : s.device_out(t);
      if (rank_ == root) s.keep(t);
      const bool is_root = rank_ == root;
      return on_device(
          s, c10d::OpType::BROADCAST, {t},
          [t, out, dt, root, timeout, is_root](DeviceCollectives& c, cudaStream_t st) {
            const at::Tensor in = is_root ? t.contiguous() : t;
            c.broadcast(cptr(in), out.data_ptr(), elems(t), dt, root, st, timeout);
          },
          plan.setup);
    });
  }
  return host_inout("broadcast", c10d::OpType::BROADCAST, tensors, "tensor",
                    [&](auto& host) { return MooncakeBackend::broadcast(host, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  DirectPlan plan;
  if (tensors.size() == 1) {
    const at::Tensor& t = tensors[0];
    DirectOps::Op op = direct_op(DirectKind::kAllReduce, elems(t));
    plan = plan_direct(op, t);
    // Past the kernels' bound with MOONCAKE_CUDA_MAPPED, eagerly: read in place,
    // one launch per piece on the caller's stream (DeviceCollectives::mapped_all_reduce).
    const bool mapped = !plan.warm && plan.chunk == 0 && plan.setup && size_ > 1 &&
                        coll_->options().mapped && direct_now() && !capturing();
    if ((plan.warm && direct_now()) || plan.chunk > 0 || mapped) {
      op.op = to_redop(opts.reduceOp, t, "all_reduce");
      if (mapped) {
        op.dtype = plan.setup->dtype;
        op.mapped = coll_->mapped_serves(op.count, op.dtype, op.op, op_timeout_ms(opts.timeout));
      }
      if (!mapped || op.mapped) {
        DirectCall call{op,        t, t, {}, wrong_device("all_reduce", "tensor", device_, {t}),
                        plan.chunk};
        return direct_run("all_reduce", c10d::OpType::ALLREDUCE, {std::move(call)}, {t},
                          op_timeout_ms(opts.timeout));
      }
    }
  }
  if (tensors.size() == 1 && on_plane({tensors[0]}, plane_bytes(plan.warm, tensors[0].nbytes()))) {
    return staged("all_reduce", Kind::kCollective, [&](Staging& s) {
      const at::Tensor t = tensors[0];
      const DType dt = to_dtype(t.scalar_type(), "all_reduce", "tensor");
      const RedOp op = to_redop(opts.reduceOp, t, "all_reduce");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      const at::Tensor out = s.device_out(t);
      return on_device(
          s, c10d::OpType::ALLREDUCE, {t},
          [t, out, dt, op, timeout](DeviceCollectives& c, cudaStream_t st) {
            const at::Tensor in = input_of(c, t);
            c.all_reduce(cptr(in), out.data_ptr(), elems(t), dt, op, st, timeout);
          },
          plan.setup);
    });
  }
  return host_inout("all_reduce", c10d::OpType::ALLREDUCE, tensors, "tensor",
                    [&](auto& host) { return MooncakeBackend::allreduce(host, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  std::vector<DirectCall> calls;
  for (const at::Tensor& t : tensors) {
    DirectOps::Op op = direct_op(DirectKind::kAllReduce, elems(t));
    const bool branch = direct_branch(op, t);
    const size_t chunk = branch ? 0 : capture_chunk(op, t);
    if (!(branch && direct_now()) && chunk == 0) break;
    op.op = to_redop(opts.reduceOp, t, "all_reduce_coalesced");
    calls.push_back(
        {op, t, t, {}, wrong_device("all_reduce_coalesced", "tensors", device_, {t}), chunk});
  }
  if (!tensors.empty() && calls.size() == tensors.size())
    return direct_run("all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, std::move(calls),
                      tensors, op_timeout_ms(opts.timeout));
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
  DirectPlan plan;
  if (tensors.size() == 1 && root >= 0 && root < size_) {
    const at::Tensor& t = tensors[0];
    DirectOps::Op op = direct_op(DirectKind::kReduce, elems(t), root);
    plan = plan_direct(op, t);
    if ((plan.warm && checked_now(false)) || plan.chunk > 0) {
      op.op = to_redop(opts.reduceOp, t, "reduce");
      DirectCall call{op,
                      t,
                      rank_ == root ? t : at::Tensor(),
                      {},
                      wrong_device("reduce", "tensor", device_, {t}),
                      plan.chunk,
                      true};
      return direct_run("reduce", c10d::OpType::REDUCE, {std::move(call)}, {t},
                        op_timeout_ms(opts.timeout));
    }
  }
  if (tensors.size() == 1 && root >= 0 && root < size_ &&
      on_plane({tensors[0]}, plane_bytes(plan.warm, tensors[0].nbytes()))) {
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
          },
          plan.setup);
    });
  }
  return host_inout("reduce", c10d::OpType::REDUCE, tensors, "tensor",
                    [&](auto& host) { return MooncakeBackend::reduce(host, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // Eagerly the path depends on the input alone (what every rank shares): a
  // list that does not fit it is this rank's bad call, rejected in step with
  // the others.
  std::optional<DirectOps::Op> warm;
  const bool checked = checked_now(true);
  if (inputs.size() == 1 && outputs.size() == 1 &&
      (checked || list_fits(outputs[0], size_, inputs[0]))) {
    const at::Tensor& in = inputs[0];
    DirectOps::Op op = direct_op(DirectKind::kAllGather, elems(in));
    if (direct_branch(op, in)) warm = op;
    const size_t chunk = warm ? 0 : capture_chunk(op, in);
    if ((warm && (checked || rooted_now())) || chunk > 0) {
      std::vector<at::Tensor> listed;  // the list, where it fits
      std::string reject =
          root_list("all_gather", "tensor_list", outputs, in, "input tensor", size_, listed);
      if (reject.empty()) reject = wrong_device("all_gather", "tensor_list", device_, listed);
      if (reject.empty()) reject = wrong_device("all_gather", "tensor", device_, {in});
      DirectCall call{op,     in,    {},  reject.empty() ? outputs[0] : std::vector<at::Tensor>{},
                      reject, chunk, true};
      return direct_run("all_gather", c10d::OpType::ALLGATHER, {std::move(call)}, outputs[0],
                        op_timeout_ms(opts.timeout));
    }
  }
  if (inputs.size() == 1 && outputs.size() == 1 &&
      on_plane_list(inputs[0], outputs[0], plane_bytes(warm, inputs[0].nbytes()))) {
    return staged("all_gather", Kind::kCollective, [&](Staging& s) {
      const at::Tensor in = inputs[0];
      const DType dt = to_dtype(in.scalar_type(), "all_gather", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      std::vector<at::Tensor> outs;
      for (const at::Tensor& t : outputs[0]) outs.push_back(s.device_out(t));
      return on_device(
          s, c10d::OpType::ALLGATHER, flat(outputs),
          [in, outs, dt, timeout](DeviceCollectives& c, cudaStream_t st) {
            const at::Tensor src = in.contiguous();
            c.all_gather(cptr(src), elems(in), dt, ptrs(outs).data(), st, timeout);
          },
          warm);
    });
  }
  return host_op("all_gather", c10d::OpType::ALLGATHER, flat(outputs), inputs, "tensor", outputs,
                 "tensor_list", [&](auto& outs, auto& ins) {
                   return MooncakeBackend::allgather(outs, ins, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  DirectPlan plan;
  if (input.defined()) {
    DirectOps::Op op = direct_op(DirectKind::kAllGather, elems(input));
    plan = plan_direct(op, input);
    if ((plan.warm && direct_now()) || plan.chunk > 0) {
      std::string reject = misfit("all_gather_into_tensor", "output_tensor (world_size x input)",
                                  output, input.numel() * size_, input);
      if (reject.empty())
        reject = wrong_device("all_gather_into_tensor", "tensors", device_, {input, output});
      DirectCall call{op, input, reject.empty() ? output : at::Tensor(), {}, reject, plan.chunk};
      return direct_run("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {std::move(call)},
                        {output}, op_timeout_ms(opts.timeout));
    }
  }
  if (output.defined() && input.defined() && output.numel() == input.numel() * size_ &&
      on_plane({input, output}, plane_bytes(plan.warm, input.nbytes()))) {
    return staged("all_gather_into_tensor", Kind::kCollective, [&](Staging& s) {
      const at::Tensor in = input;
      const DType dt = to_dtype(in.scalar_type(), "all_gather_into_tensor", "input_tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      const at::Tensor out = s.device_out(output);
      const auto world = static_cast<size_t>(size_);
      return on_device(
          s, c10d::OpType::_ALLGATHER_BASE, {output},
          [in, out, dt, timeout, world](DeviceCollectives& c, cudaStream_t st) {
            const at::Tensor src = in.contiguous();
            const auto outs = slices(out.data_ptr(), in.nbytes(), world);
            c.all_gather(cptr(src), elems(in), dt, outs.data(), st, timeout);
          },
          plan.setup);
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
  std::optional<DirectOps::Op> warm;
  if (!inputs.empty() && outputs.size() == inputs.size()) {
    std::vector<DirectCall> calls;
    for (size_t i = 0; i < inputs.size(); ++i) {
      DirectOps::Op op = direct_op(DirectKind::kAllGather, elems(inputs[i]));
      if (!list_fits(outputs[i], size_, inputs[i])) break;
      const bool branch = direct_branch(op, inputs[i]);
      const size_t chunk = branch ? 0 : capture_chunk(op, inputs[i]);
      if (!branch && chunk == 0) break;
      if (!warm) warm = op;
      std::vector<at::Tensor> all = outputs[i];
      all.push_back(inputs[i]);
      calls.push_back({op,
                       inputs[i],
                       {},
                       outputs[i],
                       wrong_device("all_gather_coalesced", "tensors", device_, all),
                       chunk});
    }
    if (calls.size() != inputs.size()) warm.reset();
    if (warm && rooted_now())
      return direct_run("all_gather_coalesced", c10d::OpType::ALLGATHER_COALESCED, std::move(calls),
                        flat(outputs), op_timeout_ms(opts.timeout));
  }
  bool plane = !inputs.empty() && outputs.size() == inputs.size();
  for (size_t i = 0; plane && i < inputs.size(); ++i)
    plane = on_plane_list(inputs[i], outputs[i], plane_bytes(warm, inputs[i].nbytes()));
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
      return on_device(
          s, c10d::OpType::ALLGATHER_COALESCED, flat(outputs),
          [ins = inputs, outs, dts, timeout = op_timeout_ms(opts.timeout)](DeviceCollectives& c,
                                                                           cudaStream_t st) {
            for (size_t i = 0; i < ins.size(); ++i) {
              const at::Tensor src = ins[i].contiguous();
              c.all_gather(cptr(src), elems(ins[i]), dts[i], ptrs(outs[i]).data(), st, timeout);
            }
          },
          warm);
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
  if (!inputs.empty() && outputs.size() == inputs.size()) {
    std::vector<DirectCall> calls;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor &in = inputs[i], &out = outputs[i];
      DirectOps::Op op = direct_op(DirectKind::kAllGather, elems(in));
      if (!in.defined()) break;
      const bool branch = direct_branch(op, in);
      const size_t chunk = branch ? 0 : capture_chunk(op, in);
      if (!(branch && direct_now()) && chunk == 0) break;
      std::string reject = misfit("all_gather_into_tensor", "output_tensor (world_size x input)",
                                  out, in.numel() * size_, in);
      if (reject.empty())
        reject = wrong_device("all_gather_into_tensor", "tensors", device_, {in, out});
      calls.push_back({op, in, reject.empty() ? out : at::Tensor(), {}, reject, chunk});
    }
    if (calls.size() == inputs.size())
      return direct_run("all_gather_into_tensor", c10d::OpType::COALESCED, std::move(calls),
                        outputs, op_timeout_ms(opts.timeout));
  }
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
  std::optional<DirectOps::Op> warm;
  if (inputs.size() == 1 && root >= 0 && root < size_) {
    const at::Tensor& in = inputs[0];
    DirectOps::Op op = direct_op(DirectKind::kGather, elems(in), root);
    if (direct_branch(op, in)) warm = op;
    const size_t chunk = warm ? 0 : capture_chunk(op, in);
    if ((warm && checked_now(true)) || chunk > 0) {
      // The root's list is its own: a bad one is rejected there, in step with the others.
      std::vector<at::Tensor> all{in};
      std::string reject =
          is_root ? root_list("gather", "gather_list", outputs, in, "input tensor", size_, all)
                  : "";
      if (reject.empty()) reject = wrong_device("gather", "tensors", device_, all);
      std::vector<at::Tensor> outs;  // the root's list, where it is good
      if (reject.empty() && is_root) outs = outputs[0];
      DirectCall call{op, in, {}, std::move(outs), reject, chunk, true};
      return direct_run("gather", c10d::OpType::GATHER, {std::move(call)}, flat(outputs),
                        op_timeout_ms(opts.timeout));
    }
  }
  if (inputs.size() == 1 && on_plane_rooted(inputs[0], outputs, root, warm.has_value())) {
    return staged("gather", Kind::kCollective, [&](Staging& s) {
      const at::Tensor in = inputs[0];
      const DType dt = to_dtype(in.scalar_type(), "gather", "tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      std::vector<at::Tensor> outs;
      if (is_root)
        for (const at::Tensor& t : outputs[0]) outs.push_back(s.device_out(t));
      return on_device(
          s, c10d::OpType::GATHER, flat(outputs),
          [in, outs, dt, root, timeout](DeviceCollectives& c, cudaStream_t st) {
            const at::Tensor src = in.contiguous();
            const auto to = ptrs(outs);
            c.gather(cptr(src), elems(in), dt, to.empty() ? nullptr : to.data(), root, st, timeout);
          },
          warm);
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
  std::optional<DirectOps::Op> warm;
  if (outputs.size() == 1 && root >= 0 && root < size_) {
    const at::Tensor& out = outputs[0];
    DirectOps::Op op = direct_op(DirectKind::kScatter, elems(out), root);
    if (direct_branch(op, out)) warm = op;
    const size_t chunk = warm ? 0 : capture_chunk(op, out);
    if ((warm && checked_now(true)) || chunk > 0) {
      std::vector<at::Tensor> all{out};
      std::string reject =
          is_root ? root_list("scatter", "scatter_list", inputs, out, "output tensor", size_, all)
                  : "";
      if (reject.empty()) reject = wrong_device("scatter", "tensors", device_, all);
      DirectCall call{op, {}, out, {}, reject, chunk, true};
      if (reject.empty() && is_root) call.ins = inputs[0];
      return direct_run("scatter", c10d::OpType::SCATTER, {std::move(call)}, {out},
                        op_timeout_ms(opts.timeout));
    }
  }
  if (outputs.size() == 1 && on_plane_rooted(outputs[0], inputs, root, warm.has_value())) {
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
      return on_device(
          s, c10d::OpType::SCATTER, {user_out},
          [ins, out, dt, root, timeout](DeviceCollectives& c, cudaStream_t st) {
            std::vector<at::Tensor> srcs;  // kept until the op is done
            std::vector<const void*> from;
            for (const at::Tensor& t : ins) {
              srcs.push_back(t.contiguous());
              from.push_back(cptr(srcs.back()));
            }
            c.scatter(from.empty() ? nullptr : from.data(), out.data_ptr(), elems(out), dt, root,
                      st, timeout);
          },
          warm);
    });
  }
  return host_op("scatter", c10d::OpType::SCATTER, outputs, inputs, "scatter_list", outputs,
                 "tensor",
                 [&](auto& outs, auto& ins) { return MooncakeBackend::scatter(outs, ins, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  // As all_gather's: eagerly the path depends on the output alone.
  std::optional<DirectOps::Op> warm;
  const bool checked = checked_now(true);
  if (inputs.size() == 1 && outputs.size() == 1 &&
      (checked || list_fits(inputs[0], size_, outputs[0]))) {
    const at::Tensor& out = outputs[0];
    DirectOps::Op op = direct_op(DirectKind::kReduceScatter, elems(out));
    if (direct_branch(op, out)) warm = op;
    const size_t chunk = warm ? 0 : capture_chunk(op, out);
    if ((warm && (checked || rooted_now())) || chunk > 0) {
      op.op = to_redop(opts.reduceOp, out, "reduce_scatter");
      std::vector<at::Tensor> listed;  // the list, where it fits
      std::string reject =
          root_list("reduce_scatter", "input_list", inputs, out, "output", size_, listed);
      if (reject.empty()) reject = wrong_device("reduce_scatter", "input_list", device_, listed);
      if (reject.empty()) reject = wrong_device("reduce_scatter", "output", device_, {out});
      DirectCall call{op, {}, out, {}, reject, chunk, true};
      if (reject.empty()) call.ins = inputs[0];
      return direct_run("reduce_scatter", c10d::OpType::REDUCE_SCATTER, {std::move(call)}, {out},
                        op_timeout_ms(opts.timeout));
    }
  }
  if (inputs.size() == 1 && outputs.size() == 1 &&
      on_plane_list(outputs[0], inputs[0],
                    plane_bytes(warm, outputs[0].nbytes() * inputs[0].size()))) {
    return staged("reduce_scatter", Kind::kCollective, [&](Staging& s) {
      std::vector<at::Tensor> ins = inputs[0];
      const at::Tensor user_out = outputs[0];
      const DType dt = to_dtype(user_out.scalar_type(), "reduce_scatter", "output");
      const RedOp op = to_redop(opts.reduceOp, user_out, "reduce_scatter");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      for (const at::Tensor& t : ins) s.keep(t);
      const at::Tensor out = s.device_out(user_out);
      return on_device(
          s, c10d::OpType::REDUCE_SCATTER, {user_out},
          [ins, out, dt, op, timeout](DeviceCollectives& c, cudaStream_t st) {
            std::vector<at::Tensor> srcs;
            for (const at::Tensor& t : ins) srcs.push_back(t.contiguous());
            std::vector<const void*> from;
            for (const at::Tensor& t : srcs) from.push_back(cptr(t));
            c.reduce_scatter(from.data(), out.data_ptr(), elems(out), dt, op, st, timeout);
          },
          warm);
    });
  }
  return host_op("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs, inputs, "input_list",
                 outputs, "output", [&](auto& outs, auto& ins) {
                   return MooncakeBackend::reduce_scatter(outs, ins, opts);
                 });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  DirectPlan plan;
  if (output.defined()) {
    DirectOps::Op op = direct_op(DirectKind::kReduceScatter, elems(output));
    plan = plan_direct(op, output);
    if ((plan.warm && direct_now()) || plan.chunk > 0) {
      op.op = to_redop(opts.reduceOp, output, "reduce_scatter_tensor");
      std::string reject = misfit("reduce_scatter_tensor", "input (world_size x output)", input,
                                  output.numel() * size_, output);
      if (reject.empty())
        reject = wrong_device("reduce_scatter_tensor", "tensors", device_, {input, output});
      DirectCall call{op, reject.empty() ? input : at::Tensor(), output, {}, reject, plan.chunk};
      return direct_run("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE,
                        {std::move(call)}, {output}, op_timeout_ms(opts.timeout));
    }
  }
  if (output.defined() && input.defined() && input.numel() == output.numel() * size_ &&
      on_plane({input, output}, plane_bytes(plan.warm, input.nbytes()))) {
    return staged("reduce_scatter_tensor", Kind::kCollective, [&](Staging& s) {
      const at::Tensor in = input;
      const DType dt = to_dtype(in.scalar_type(), "reduce_scatter_tensor", "input");
      const RedOp op = to_redop(opts.reduceOp, in, "reduce_scatter_tensor");
      const int64_t timeout = op_timeout_ms(opts.timeout);
      s.keep(in);
      const at::Tensor out = s.device_out(output);
      const auto world = static_cast<size_t>(size_);
      return on_device(
          s, c10d::OpType::_REDUCE_SCATTER_BASE, {output},
          [in, out, dt, op, timeout, world](DeviceCollectives& c, cudaStream_t st) {
            const at::Tensor src = in.contiguous();
            const auto parts = slices(src.data_ptr(), out.nbytes(), world);
            std::vector<const void*> from(parts.begin(), parts.end());
            c.reduce_scatter(from.data(), out.data_ptr(), elems(out), dt, op, st, timeout);
          },
          plan.setup);
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
  if (!inputs.empty() && outputs.size() == inputs.size()) {
    std::vector<DirectCall> calls;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor &in = inputs[i], &out = outputs[i];
      DirectOps::Op op = direct_op(DirectKind::kReduceScatter, elems(out));
      if (!out.defined()) break;
      const bool branch = direct_branch(op, out);
      const size_t chunk = branch ? 0 : capture_chunk(op, out);
      if (!(branch && direct_now()) && chunk == 0) break;
      op.op = to_redop(opts.reduceOp, out, "reduce_scatter_tensor");
      std::string reject = misfit("reduce_scatter_tensor", "input (world_size x output)", in,
                                  out.numel() * size_, out);
      if (reject.empty())
        reject = wrong_device("reduce_scatter_tensor", "tensors", device_, {in, out});
      calls.push_back({op, reject.empty() ? in : at::Tensor(), out, {}, reject, chunk});
    }
    if (calls.size() == inputs.size())
      return direct_run("reduce_scatter_tensor", c10d::OpType::COALESCED, std::move(calls), outputs,
                        op_timeout_ms(opts.timeout));
  }
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
    std::vector<size_t> out_counts, int64_t timeout, std::optional<DirectOps::Op> setup) {
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
      },
      setup);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::vary_run(
    const char* name, c10d::OpType type, const at::Tensor& t, DirectCall call, std::string reject,
    const std::vector<size_t>& in_counts, const std::vector<size_t>& out_counts,
    std::vector<at::Tensor> results, int64_t timeout) {
  if (capturing() || !checked_now(true)) return {};
  DirectOps::Op op = direct_op(DirectKind::kAllToAll, 0);
  op.vary = true;
  if (!direct_branch(op, t)) return {};
  const auto me = static_cast<size_t>(rank_);
  if (reject.empty() &&
      (in_counts.size() != static_cast<size_t>(size_) || out_counts.size() != in_counts.size()))
    reject = str(name, ": the input and the output must each have world_size (", size_,
                 ") parts, got ", in_counts.size(), " and ", out_counts.size());
  if (reject.empty() && in_counts[me] != out_counts[me])
    reject = str(name, ": rank ", rank_, " sends itself ", in_counts[me], " elements but expects ",
                 out_counts[me], " from itself");
  const size_t esize = dtype_size(op.dtype);
  if (reject.empty() && size_ > 1) {
    // (The kernel would find such a pair's sizes unfit at both ends.)
    const size_t most = coll_->vary_max_part();
    for (size_t p = 0; p < in_counts.size() && reject.empty(); ++p)
      if (std::max(in_counts[p], out_counts[p]) * esize > most)
        reject = str(name, ": a part of ", std::max(in_counts[p], out_counts[p]) * esize,
                     " bytes is past the most one launch moves (", most,
                     " bytes: 65535 rounds of the segment's region per rank); raise "
                     "MOONCAKE_CUDA_SEGMENT_BYTES");
  }
  if (reject.empty()) {
    for (size_t p = 0; p < in_counts.size(); ++p) {
      op.send_bytes.push_back(in_counts[p] * esize);
      op.recv_bytes.push_back(out_counts[p] * esize);
    }
  } else {
    call.in = call.out = at::Tensor();
    call.ins.clear();
    call.outs.clear();
  }
  call.op = op;
  call.reject = std::move(reject);
  call.watch = true;
  return direct_run(name, type, {std::move(call)}, std::move(results), timeout);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  // Eagerly, with split sizes or without, one launch of per-pair sizes: no
  // rank needs another's sizes to take it (vary_run).
  if (input.defined() && output.defined()) {
    std::string reject = wrong_device("all_to_all_single", "tensors", device_, {input, output});
    if (reject.empty() && (output.scalar_type() != input.scalar_type() ||
                           output.layout() != at::kStrided || input.layout() != at::kStrided))
      reject = str("all_to_all_single: output must be a dense tensor of the input's dtype (",
                   dtype_str(input.scalar_type()), "), got ", dtype_str(output.scalar_type()));
    std::vector<size_t> in_counts, out_counts;
    if (reject.empty()) {
      try {
        in_counts = split_counts(input, input_split_sizes, size_, "input_split_sizes", "input");
        out_counts =
            split_counts(output, output_split_sizes, size_, "output_split_sizes", "output");
      } catch (const Error& e) {
        reject = e.what();
      }
    }
    DirectCall call{{}, input, output, {}, {}, 0, true};
    auto work =
        vary_run("all_to_all_single", c10d::OpType::ALLTOALL_BASE, input, std::move(call),
                 std::move(reject), in_counts, out_counts, {output}, op_timeout_ms(opts.timeout));
    if (work) return work;
  }
  // Inputs differ in size from rank to rank, so whether the op takes the
  // plane must not depend on sizes: it does whenever the plane serves the
  // group, for split lists of the world size (longer ones, which reach ranks
  // that joined past it, are staged).
  // Without split sizes every rank's parts are equal, so every rank agrees on
  // the device-driven kernels; with them, parts may differ between ranks, so
  // they take the kernels only under CUDA graph capture and when they are
  // equal (as functional collectives pass them), and otherwise the device
  // plane (or staging).
  const bool no_splits = input_split_sizes.empty() && output_split_sizes.empty();
  std::optional<DirectOps::Op> setup;  // the plane's call sets the kernels up (no splits)
  if (input.defined() &&
      (no_splits || (rooted_now() && equal_splits(input, input_split_sizes, size_) &&
                     equal_splits(output, output_split_sizes, size_)))) {
    DirectOps::Op op = direct_op(DirectKind::kAllToAll, elems(input) / static_cast<size_t>(size_));
    const DirectPlan plan = plan_direct(op, input);
    if (no_splits) setup = plan.setup;
    if ((plan.warm && direct_now()) || plan.chunk > 0) {
      std::string reject =
          input.numel() % size_ != 0
              ? str("all_to_all_single: input must split into world_size (", size_,
                    ") equal parts without split sizes, got ", input.numel(), " elements")
              : misfit("all_to_all_single", "output", output, input.numel(), input);
      if (reject.empty())
        reject = wrong_device("all_to_all_single", "tensors", device_, {input, output});
      DirectCall call{op, input, reject.empty() ? output : at::Tensor(), {}, reject, plan.chunk};
      return direct_run("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {std::move(call)},
                        {output}, op_timeout_ms(opts.timeout));
    }
  }
  MC_CHECK_ARG(!capturing() || no_splits ||
                   (equal_splits(input, input_split_sizes, size_) &&
                    equal_splits(output, output_split_sizes, size_)),
               "all_to_all_single under CUDA graph capture: split sizes must be equal (or "
               "none: equal parts, the input's numel divisible by the world size); parts of "
               "other sizes are not capturable");
  const auto world = static_cast<size_t>(size_);
  if (input_split_sizes.size() <= world && output_split_sizes.size() <= world &&
      on_plane({input, output}, std::nullopt)) {
    return staged("all_to_all_single", Kind::kCollective, [&](Staging& s) {
      return all_to_all_on_device(
          s, "all_to_all_single", c10d::OpType::ALLTOALL_BASE, {input}, {output},
          split_counts(input, input_split_sizes, size_, "input_split_sizes", "input"),
          split_counts(output, output_split_sizes, size_, "output_split_sizes", "output"),
          op_timeout_ms(opts.timeout), setup);
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
  // Eagerly, one launch of per-pair sizes (vary_run). Under CUDA graph
  // capture, equal parts take the device-driven kernels (every rank must pass
  // parts of one size).
  if (!inputs.empty() && !outputs.empty() && inputs[0].defined()) {
    std::vector<at::Tensor> all = inputs;
    all.insert(all.end(), outputs.begin(), outputs.end());
    std::string reject = wrong_device("all_to_all", "tensors", device_, all);
    for (const at::Tensor& t : all)
      if (reject.empty() && (!t.defined() || t.layout() != at::kStrided ||
                             t.scalar_type() != inputs[0].scalar_type()))
        reject =
            str("all_to_all: every tensor of input_tensor_list and output_tensor_list "
                "must be a dense tensor of ",
                dtype_str(inputs[0].scalar_type()), " (the first input's dtype)");
    std::vector<size_t> in_counts, out_counts;
    for (const at::Tensor& t : inputs) in_counts.push_back(t.defined() ? elems(t) : 0);
    for (const at::Tensor& t : outputs) out_counts.push_back(t.defined() ? elems(t) : 0);
    DirectCall call{{}, {}, {}, outputs, {}, 0, true, inputs};
    auto work =
        vary_run("all_to_all", c10d::OpType::ALLTOALL, inputs[0], std::move(call),
                 std::move(reject), in_counts, out_counts, outputs, op_timeout_ms(opts.timeout));
    if (work) return work;
  }
  if (rooted_now() && !inputs.empty() && inputs.size() == static_cast<size_t>(size_) &&
      list_fits(inputs, inputs.size(), inputs[0]) && list_fits(outputs, inputs.size(), inputs[0])) {
    DirectOps::Op op = direct_op(DirectKind::kAllToAll, elems(inputs[0]));
    const bool branch = direct_branch(op, inputs[0]);
    const size_t chunk = branch ? 0 : capture_chunk(op, inputs[0]);
    if (branch || chunk > 0) {
      std::vector<at::Tensor> all = inputs;
      all.insert(all.end(), outputs.begin(), outputs.end());
      std::string reject = wrong_device("all_to_all", "tensors", device_, all);
      const at::Tensor in = reject.empty() ? cat_flat(inputs) : at::Tensor();
      DirectCall call{op, in, {}, outputs, reject, chunk};
      return direct_run("all_to_all", c10d::OpType::ALLTOALL, {std::move(call)}, outputs,
                        op_timeout_ms(opts.timeout));
    }
  }
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
  if (p2p_on_device(tensors, dst, false)) return send_on_device(tensors, dst, tag);
  count_staged(has_cuda(tensors));
  return staged("send", Kind::kSend, [&](Staging& s) {
    auto host = s.in(tensors, "tensor");
    return s.run(c10d::OpType::SEND, tensors,
                 [&] { return MooncakeBackend::send(host, dst, tag); });
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::recv(std::vector<at::Tensor>& tensors, int src,
                                                         int tag) {
  if (p2p_on_device(tensors, src, true)) return recv_on_device(tensors, src, tag);
  count_staged(has_cuda(tensors));
  return staged("recv", Kind::kRecv, [&](Staging& s) {
    auto host = s.out(tensors, "tensor");
    return s.run(c10d::OpType::RECV, tensors,
                 [&] { return MooncakeBackend::recv(host, src, tag); });
  });
}

// --- point-to-point device to device (p2p_buffers.h) -------------------------------------

namespace {

// How many p2p timeouts a sender waits for a receiver's ack before it gives
// the buffer up for good (a recv may still take the note later: the buffer
// is never lent again).
constexpr int64_t kAckWaitTimeouts = 4;

at::Tensor note_tensor() {
  return at::empty({static_cast<int64_t>(sizeof(P2PNote))}, at::TensorOptions().dtype(at::kByte));
}

struct AckJob {
  std::shared_ptr<P2PAckPort> port;
  int dst;
  uint64_t tag;
};

// A CUDA host callback: the receiver's copy out of the sender's buffer is
// done. No CUDA call may be made here (the ack is a host message), and
// nothing may be thrown.
void CUDART_CB ack_copied(void* arg) {
  const std::unique_ptr<AckJob> job(static_cast<AckJob*>(arg));
  job->port->send(job->dst, job->tag, static_cast<uint64_t>(P2PAck::kCopied));
}

// A recv's landing (StagedOp::land, on `stream`): the note in `host` names
// the sender's buffer, whose bytes are copied into `t`; the sender hears
// once the copy is done, or at once that this rank refused the message.
void land_note(const at::Tensor& host, const at::Tensor& t, P2PBuffers& buffers,
               const std::shared_ptr<P2PAckPort>& acks, cudaStream_t stream) {
  P2PNote note;
  std::memcpy(&note, host.data_ptr(), sizeof(note));
  MC_ASSERT(note.magic == P2PNote::kMagic, "recv: a device-to-device note is malformed");
  const uint64_t ack = p2p_ack_tag(note.id);
  bool queued = false;
  try {
    if (note.bytes != t.nbytes())
      throw_error(ErrorKind::kInvalidArgument, -1, "recv: rank ", note.src, " sent ", note.bytes,
                  " bytes, the tensor holds ", t.nbytes());
    void* from = buffers.open(note.handle);
    if (t.is_contiguous()) {
      cuda_check(cudaMemcpyAsync(t.data_ptr(), from, t.nbytes(), cudaMemcpyDeviceToDevice, stream),
                 "copying a recv out of the sender's buffer");
    } else {
      // (its bytes lie in the sender's GPU's memory, which this one maps)
      const at::Tensor bytes = at::for_blob(from, t.sizes())
                                   .options(t.options())
                                   .target_device(t.device())
                                   .make_tensor();
      t.copy_(bytes, /*non_blocking=*/true);
    }
    queued = true;
    auto job = std::make_unique<AckJob>(AckJob{acks, note.src, ack});
    cuda_check(cudaLaunchHostFunc(stream, ack_copied, job.get()),
               "cudaLaunchHostFunc of a recv's ack");
    job.release();  // ack_copied owns it now
  } catch (...) {
    // The sender's buffer is free once nothing here reads it.
    if (queued) cudaStreamSynchronize(stream);
    acks->send(note.src, ack, static_cast<uint64_t>(P2PAck::kRefused));
    throw;
  }
}

}  // namespace

void P2PAckPort::send(int dst, uint64_t tag, uint64_t word) noexcept {
  try {
    auto msg = std::make_shared<uint64_t>(word);
    std::lock_guard<std::mutex> lock(mu);
    if (p2p == nullptr) return;  // shut down: the sender's buffers go with its group
    std::shared_ptr<Request> r = p2p->send(msg.get(), sizeof(uint64_t), dst, tag);
    r->on_complete([msg](std::exception_ptr) {});  // the word lives until sent
  } catch (...) {
    // Not sent (shut down meanwhile, out of memory): the sender never lends that
    // buffer again.
  }
}

void P2PAckPort::open(P2P& channel) {
  std::lock_guard<std::mutex> lock(mu);
  if (!closed) p2p = &channel;
}

void MooncakeCudaBackend::close_acks() {
  std::lock_guard<std::mutex> lock(acks_->mu);
  acks_->p2p = nullptr;
  acks_->closed = true;
}

bool MooncakeCudaBackend::p2p_on_device(const std::vector<at::Tensor>& tensors, int peer,
                                        bool any_source) {
  if (p2p_bytes_ == 0 || tensors.size() != 1 || shut_down()) return false;
  const at::Tensor& t = tensors[0];
  if (!t.defined() || !t.is_cuda() || t.device().index() != device_ || t.layout() != at::kStrided ||
      t.nbytes() < p2p_bytes_)
    return false;
  // (A bad peer goes on to the host path's checks, which name it.)
  if (peer == rank_ || peer < (any_source ? -1 : 0) || peer >= size_ || size_ < 2 ||
      comm().capacity() != size_)
    return false;
  if (capturing()) return false;  // the staged path raises what a capture may not do
  return coll_->serves(std::nullopt, timeout_ms());
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::send_on_device(std::vector<at::Tensor>& tensors,
                                                                   int dst, int tag) {
  const at::Tensor& t = tensors[0];
  acks_->open(p2p());
  std::shared_ptr<P2PBuffers> buffers = p2p_buffers_;
  const P2PBuffers::Lent lent = buffers->lend(t.nbytes());
  const uint64_t id = lent.id;
  try {
    P2PNote note;
    note.bytes = t.nbytes();
    note.id = id;
    note.src = rank_;
    note.handle = lent.handle;
    at::Tensor host = note_tensor();
    std::memcpy(host.data_ptr(), &note, sizeof(note));
    // The ack, posted first. It gives the buffer back (copied or refused);
    // anything else (a receiver failed, or silent and maybe only stalled, or
    // no recv for kAckWaitTimeouts timeouts) keeps the buffer from being lent
    // again.
    auto word = std::make_shared<uint64_t>(0);
    p2p()
        .recv(word.get(), sizeof(uint64_t), dst, p2p_ack_tag(id),
              kAckWaitTimeouts * p2p_timeout_ms())
        ->on_complete([buffers, word, id](std::exception_ptr e) {
          if (e)
            buffers->forget(id);
          else
            buffers->give_back(id);
        });
    auto work = staged("send", Kind::kSend, [&](Staging& s) {
      s.copy_into(lent.ptr, t);
      return s.run(c10d::OpType::SEND, tensors, [&] {
        std::shared_ptr<Request> r =
            p2p().send(host.data_ptr(), sizeof(P2PNote), dst, p2p_note_tag(tag));
        // A note whose send failed may have arrived all the same (a transport
        // can fail after the payload): its buffer is never lent again.
        r->on_complete([host, buffers, id](std::exception_ptr e) {
          if (e) buffers->forget(id);
        });
        return wrap(r, c10d::OpType::SEND, {host});
      });
    });
    ++p2p_device_ops_;
    return work;
  } catch (...) {
    buffers->give_back(id);  // (before the note went out)
    throw;
  }
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::recv_on_device(std::vector<at::Tensor>& tensors,
                                                                   int src, int tag) {
  const at::Tensor t = tensors[0];
  acks_->open(p2p());
  at::Tensor host = note_tensor();
  std::shared_ptr<P2PBuffers> buffers = p2p_buffers_;
  std::shared_ptr<P2PAckPort> acks = acks_;
  auto work = staged("recv", Kind::kRecv, [&](Staging& s) {
    s.land_with(t, [host, t, buffers, acks](cudaStream_t stream) {
      land_note(host, t, *buffers, acks, stream);
    });
    return s.run(c10d::OpType::RECV, tensors, [&] {
      std::shared_ptr<Request> r =
          p2p().recv(host.data_ptr(), sizeof(P2PNote), src, p2p_note_tag(tag));
      return wrap(r, c10d::OpType::RECV, {host});
    });
  });
  ++p2p_device_ops_;
  return work;
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
