// The c10d::Backend registered as "mooncake": mooncake-cpu's ops, failure
// handling and membership for CUDA tensors (and, unchanged, for CPU tensors,
// so one group serves both).
//
// Data path: when every rank runs on this host, a collective whose input
// at the root (every part of it) is at most MOONCAKE_CUDA_DIRECT_BYTES can
// take the device-driven kernels (device/direct_ops.h): launched on the
// caller's current stream, with no host round and no host wait, so that it
// can be captured in a CUDA graph. all_reduce, all_gather_into_tensor,
// reduce_scatter_tensor, all_to_all_single without split sizes and their
// coalesced forms take them eagerly too; the rooted ops, the list forms and
// all_to_all_single with equal split sizes only under capture (see
// cuda_backend.cc for why). Under capture larger ones take them as one
// launch per piece of each part; an op they cannot serve raises ValueError:
// point-to-point ops, barrier, uneven all_to_all, ops in a group that spans
// hosts. A group of one rank serves every op locally, at any size, eagerly
// too. The kernels' first call, and the first after a membership change, sets
// them up with a host op among the members (through the op queue); after that
// a call goes straight to the GPU, unless an op of this backend queued before
// it has not finished its host part yet (then it waits its turn in the op
// queue, on the backend's stream, as every other op does). The other
// collectives run on the device collectives (device/collectives.h: from
// MOONCAKE_CUDA_PLANE_MIN_BYTES up, or any size where the kernels could serve
// them, through the segment in pieces): GPU to GPU through mapped segments,
// with the host's failure handling. List forms take either with one tensor
// per rank of the world (longer lists reach ranks that joined past it and
// are staged), so every rank of such an op must pass lists of the same length.
//
// Every other op is staged through pinned host memory on a stream of the
// backend's own, around the host op (cuda_staging.h):
//   caller's stream ──event──> staging stream: device → host copies
//   op thread: waits for those copies, runs mooncake-cpu's op on the host
//              copies (agreement, re-runs and hand-on as on the CPU)
//   staging stream: host → device copies of the results, then a done event.
// This path also serves peers on other hosts.
//
// Either way the caller's thread only queues work: an op returns at once,
// and Work.wait() makes the caller's current stream wait for the done event
// (blocking the host only until the host op has finished, never on the
// GPU). The future carries the device's events. A send copies its tensor to
// the host before it is posted (the caller waits for that copy).
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "device/collectives.h"
#include "device/p2p_buffers.h"
#include "torch/backend.h"

namespace mooncake {

class Staging;
struct StagedOp;

// The p2p channel, for a device-to-device recv's ack sent from a CUDA host
// callback (no CUDA call there): closed (null) before shutdown takes the
// channel away.
struct P2PAckPort {
  std::mutex mu;
  P2P* p2p = nullptr;
  bool closed = false;
  void open(P2P& channel);  // (unless closed)
  void send(int dst, uint64_t tag, uint64_t word) noexcept;
};
struct WatchedOps;

// One op on the device-driven kernels: its kind, count, reduce op and root
// (`op`; in and out are filled in when it runs); this rank's input, every
// part (undefined: none); its output, every part, or a list form's `outs`,
// one tensor per part (neither: none); and `reject` (not empty: this rank's
// call is bad: it takes part without data, so that the ranks stay in step,
// then raises ValueError with it); `watch`: an eager launch leaves what it
// found in a slot, and the Work's wait() raises it as the plane would
// (raise_outcome, cuda_staging.h); `ins`: this rank's input as a list, one
// tensor per part (then `in` is undefined).
struct DirectCall {
  DirectOps::Op op;
  at::Tensor in, out;
  std::vector<at::Tensor> outs;
  std::string reject;
  // Elements of each part a launch takes (0: the whole op in one): an op past
  // the kernels' bound goes, under capture, as one launch per piece of each
  // part.
  size_t chunk = 0;
  bool watch = false;
  std::vector<at::Tensor> ins;
};

class MooncakeCudaBackend final : public MooncakeBackend {
 public:
  // Device tensors must be on the CUDA device current when the group is made.
  MooncakeCudaBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                      std::chrono::milliseconds timeout,
                      c10::intrusive_ptr<MooncakeBackendOptions> options,
                      std::shared_ptr<TransferEngine> engine);
  ~MooncakeCudaBackend() override;

  static constexpr const char* kName = "mooncake";
  const std::string getBackendName() const override { return kName; }
  void shutdown() override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

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
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // The active_ranks tensor given in the options (CUDA or CPU), else a CUDA one.
  at::Tensor active_ranks() const override;
  int device() const { return device_; }
  // CUDA-tensor ops so far that ran on the device plane and that were staged
  // through host memory: tests assert which path served them.
  std::pair<int64_t, int64_t> op_paths() const { return {device_ops_.load(), staged_ops_.load()}; }
  // Of the device plane's ops, those that ran on the device-driven kernels
  // (a captured one is counted once, when captured).
  int64_t direct_ops() const { return direct_ops_.load(); }
  // The mapped all_reduce's pieces (DeviceCollectives::mapped_pieces): run by
  // its launch, and on the plane.
  std::pair<int64_t, int64_t> mapped_pieces() const {
    return coll_ ? coll_->mapped_pieces() : std::pair<int64_t, int64_t>{0, 0};
  }
  // Sends and recvs that went device to device (MOONCAKE_CUDA_P2P_BYTES), and
  // the buffers of its sends not yet acknowledged.
  int64_t p2p_device_ops() const { return p2p_device_ops_.load(); }
  int64_t p2p_lent() const { return p2p_buffers_ ? static_cast<int64_t>(p2p_buffers_->lent()) : 0; }

 protected:
  void view_changed(const at::Tensor& active) override;

 private:
  friend class Staging;
  enum class Kind { kCollective, kSend, kRecv };
  // Runs `build(staging)`, which makes host copies of the op's tensors and
  // calls mooncake-cpu's op on them; returns a Work that completes once the
  // results are back on the device. A collective rejected here (a tensor on
  // the wrong device) still takes its part, as mooncake-cpu's do.
  template <typename Build>
  c10::intrusive_ptr<c10d::Work> staged(const char* op, Kind kind, Build&& build);

  // The staged form of an op whose inputs `in` are copied to the host and
  // whose outputs `out` back: `call(host_out, host_in)` runs mooncake-cpu's op.
  template <typename In, typename Out, typename HostOp>
  c10::intrusive_ptr<c10d::Work> host_op(const char* op, c10d::OpType type,
                                         std::vector<at::Tensor> results, const In& in,
                                         const char* in_arg, const Out& out, const char* out_arg,
                                         HostOp&& call);
  // The same for an op whose `tensors` are both input and output.
  template <typename HostOp>
  c10::intrusive_ptr<c10d::Work> host_inout(const char* op, c10d::OpType type,
                                            std::vector<at::Tensor>& tensors, const char* arg,
                                            HostOp&& call);

  // Whether an op whose tensors are `tensors` and whose input is `bytes`
  // long runs on the device collectives: the decision depends only on what
  // every rank of the op shares (the group, the dtype, the size), so that all
  // of them take the same path.
  // `bytes` nullopt: an op whose inputs differ in size between ranks (any fits).
  bool on_plane(const std::vector<at::Tensor>& tensors, std::optional<size_t> bytes);
  // The same for a list form: `list` holds one tensor per rank of the world,
  // each with as many elements as `one`.
  bool on_plane_list(const at::Tensor& one, const std::vector<at::Tensor>& list,
                     std::optional<size_t> bytes);
  // The same for gather/scatter: `one` (the input, or the output) decides on every rank;
  // the root's `lists` (one list of a tensor per rank) must fit it too, or the root's
  // call is a bad one, which the staged path rejects on every rank.
  // any_size: as on_plane's `bytes` nullopt.
  bool on_plane_rooted(const at::Tensor& one, const std::vector<std::vector<at::Tensor>>& lists,
                       int root, bool any_size = false);
  // Counts a staged op when it moves CUDA tensors (CPU tensors are not staged).
  void count_staged(bool cuda) {
    if (cuda) ++staged_ops_;
  }
  // Runs `move(collectives, stream)` on the op thread, on the staging stream
  // (after the caller's stream has reached the op), and returns its Work.
  // `warm`: an op the device-driven kernels serve (a list form, which takes
  // them under capture only): they are set up first where they are not, so
  // that the op's eager warm-up readies its capture.
  template <typename Move>
  c10::intrusive_ptr<c10d::Work> on_device(Staging& s, c10d::OpType type,
                                           std::vector<at::Tensor> results, Move move,
                                           std::optional<DirectOps::Op> warm = std::nullopt);
  // Whether `op` takes the device-driven kernels, decided from `t` (a tensor
  // of the op every rank holds with the same dtype and element count), and
  // `op`'s dtype set from it: the same answer on every rank of the op,
  // whatever t's device is (a CUDA tensor on another device is rejected when
  // the op runs, in step with the others).
  bool direct_branch(DirectOps::Op& op, const at::Tensor& t);
  // Under capture, for an op of `t` that the kernels do not serve whole: the
  // elements of each part one launch takes where they serve it in pieces (the
  // op's dtype set), else 0. Eagerly such an op takes the device plane, whose
  // results a failure cannot split between pieces.
  size_t capture_chunk(DirectOps::Op& op, const at::Tensor& t);
  // For an op past the device-driven kernels' bound (it takes the device
  // plane): one element of it, where they serve that, for its plane call to
  // set them up with (on_device's `warm`), else none. A group whose eager ops
  // are all large can then capture them (in pieces).
  std::optional<DirectOps::Op> one_element(DirectOps::Op op, const at::Tensor& t);
  // The three answers above for an op of `t`, asked in that order.
  struct DirectPlan {
    std::optional<DirectOps::Op> warm;   // the kernels serve it whole (direct_branch)
    std::optional<DirectOps::Op> setup;  // its plane call sets them up with this
    size_t chunk = 0;                    // capture_chunk
  };
  DirectPlan plan_direct(DirectOps::Op& op, const at::Tensor& t);
  // Runs `calls` in order as one op `name` of `type` whose Work reports
  // `results`: on the caller's stream at once where the kernels are set up
  // (and always under CUDA graph capture), else through the op queue (where
  // the first call sets them up with a host op).
  c10::intrusive_ptr<c10d::Work> direct_run(const char* name, c10d::OpType type,
                                            std::vector<DirectCall> calls,
                                            std::vector<at::Tensor> results, int64_t timeout);
  // Whether the caller's current stream is capturing a CUDA graph (or was,
  // and the capture was invalidated): capture_status() is not None.
  bool capturing() const;
  cudaStreamCaptureStatus capture_status() const;
  // Whether the group is this rank alone, with no slot for another to join
  // and the kernels on (DeviceCollectives::direct_alone).
  bool alone();
  // Whether the ops the kernels take under capture only (all_gather_coalesced,
  // all_to_all's list form, split sizes) take them now: under capture, and
  // always alone.
  bool rooted_now();
  // Whether the rooted ops (broadcast, reduce, gather, scatter) and the list
  // forms of all_gather and reduce_scatter take them now: as direct_now(),
  // their eager launches watched (DirectCall::watch). `lists`: the op takes a
  // list of world-size tensors, which a group with slots past its world size
  // may pass longer (extend_group_size_to): such a group keeps the plane.
  bool checked_now(bool lists);
  // An eager all_to_all (list form, or all_to_all_single with or without
  // split sizes) as one launch with per-pair sizes (DirectOps::Op::vary),
  // watched: where the kernels serve the group, at any sizes, alike at every
  // rank (the path depends on the group and the dtype only). `op` names the
  // call; `t` is the tensor whose dtype the op takes; `ins`/`outs` its parts
  // (all_to_all_single: `in`/`out` with `in_counts`/`out_counts`, elements).
  // Null where the kernels do not serve it now.
  c10::intrusive_ptr<c10d::Work> vary_run(const char* name, c10d::OpType type, const at::Tensor& t,
                                          DirectCall call, std::string reject,
                                          const std::vector<size_t>& in_counts,
                                          const std::vector<size_t>& out_counts,
                                          std::vector<at::Tensor> results, int64_t timeout);
  // Checks every watched launch made since the last call (waiting for those
  // not done yet): whether one found a member lost, which then the op being
  // issued sets right on the op queue (DeviceCollectives::direct_resync). Every
  // rank asks at the same op, after the same launches, all of whose outcomes
  // agree: so every rank decides alike.
  bool settle_watched();
  // Whether an op the kernels serve takes them now, where it may also take
  // the device plane: under capture, and eagerly when the group re-runs its
  // ops among the survivors of a failure (the default), whose results the
  // kernels give. A group whose ops fail instead (auto_deactivate_on_failure
  // or auto_sync_on_failure False, MOONCAKE_RECOVER=0) takes the plane
  // eagerly, which raises PeerFailedError (alone: no failure to meet).
  bool direct_now();
  // Whether the collective this backend queued last has finished its host
  // part, its results' copies queued (then a launch on the caller's stream
  // goes in order with it, once the stream waits for those: join_queued).
  bool host_idle() const;
  void join_queued(cudaStream_t stream);
  // Remembers `work` as the last collective queued.
  void queued(const c10::intrusive_ptr<c10d::Work>& work);
  // all_to_all_single (one tensor each, sliced by the counts) and all_to_all
  // (one tensor per rank) on the device collectives; `setup` as on_device's
  // `warm` (only where every rank's parts are alike: no split sizes).
  c10::intrusive_ptr<c10d::Work> all_to_all_on_device(
      Staging& s, const char* op, c10d::OpType type, const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs, std::vector<size_t> in_counts,
      std::vector<size_t> out_counts, int64_t timeout,
      std::optional<DirectOps::Op> setup = std::nullopt);

  // Whether a send or recv of `tensors` with `peer` goes device to device
  // (p2p_buffers.h): MOONCAKE_CUDA_P2P_BYTES set, one CUDA tensor of at least
  // that many bytes on this device, eagerly, every rank of the group on this
  // host with its GPU mapped (DeviceCollectives::serves) and no rank past
  // the world size (`any_source`: a recv's -1 too). Inside coalescing blocks
  // too. Both ends of a message decide alike where both pass CUDA tensors of
  // one size; a note travels on a tag of its own, so an end that stages never
  // meets one (its recv times out).
  bool p2p_on_device(const std::vector<at::Tensor>& tensors, int peer, bool any_source);
  c10::intrusive_ptr<c10d::Work> send_on_device(std::vector<at::Tensor>& tensors, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv_on_device(std::vector<at::Tensor>& tensors, int src, int tag);
  void close_acks();

  int device_ = -1;  // -1: this process sees no GPU (CPU tensors only)
  std::optional<c10::cuda::CUDAStream> stream_;
  at::Tensor user_active_;                   // what active_ranks() returns
  std::unique_ptr<DeviceCollectives> coll_;  // null: every op is staged through the host
  std::atomic<int64_t> device_ops_{0}, staged_ops_{0}, direct_ops_{0}, p2p_device_ops_{0};
  size_t p2p_bytes_ = 0;  // MOONCAKE_CUDA_P2P_BYTES (0: off)
  std::shared_ptr<P2PBuffers> p2p_buffers_;
  std::shared_ptr<P2PAckPort> acks_ = std::make_shared<P2PAckPort>();
  // The last collective queued on the op queue (host_idle): its request, and
  // the copies that bring its results back.
  std::shared_ptr<Request> last_request_;
  std::vector<std::shared_ptr<StagedOp>> last_stages_;
  // The watched eager launches since the last op that took the kernels' path
  // (settle_watched).
  std::vector<std::shared_ptr<WatchedOps>> watched_;
  // A queued op's watched launch found the view must catch up: the next op
  // that may take the kernels sets them up again (taken by direct_run where
  // the queue is idle, else by that op on the queue).
  std::atomic<bool> resync_pending_{false};
  // Inside a coalescing block: the staged ops whose results it brings back.
  bool staging_coalesced_ = false;
  std::vector<std::shared_ptr<StagedOp>> coalesced_;
};

}  // namespace mooncake
