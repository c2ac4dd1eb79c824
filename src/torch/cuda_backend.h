// The c10d::Backend registered as "mooncake": mooncake-cpu's ops, failure
// handling and membership for CUDA tensors (and, unchanged, for CPU tensors,
// so one group serves both).
//
// Data path: each op's device tensors are staged through pinned host memory
// on a stream of the backend's own, around the host op:
//   caller's stream ──event──> staging stream: device → host copies
//   op thread: waits for those copies, runs mooncake-cpu's op on the host
//              copies (agreement, re-runs and hand-on as on the CPU)
//   staging stream: host → device copies of the results, then a done event.
// The caller's thread only queues work: an op returns at once, and
// Work.wait() makes the caller's current stream wait for the done event
// (blocking the host only until the host op has finished, never on the
// GPU). The future carries the device's events. A send copies its tensor to
// the host before it is posted (the caller waits for that copy).
//
// This is the portable device path (it also serves peers on other hosts).
// When every rank runs on this host, all_reduce, broadcast, all_gather and
// reduce_scatter (tensor and list forms) whose segment bytes are between
// MOONCAKE_CUDA_PLANE_MIN_BYTES and MOONCAKE_CUDA_SEGMENT_BYTES, and every
// all_to_all_single and all_to_all, take the device plane instead
// (cuda_plane.h): GPU to GPU through mapped segments, with the same failure
// handling. List forms take it with one tensor per rank of the world (longer
// lists reach ranks that joined past it and are staged), so every rank of
// such an op must pass lists of the same length.
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <optional>
#include <vector>

#include "core/dtype.h"
#include "torch/backend.h"
#include "torch/cuda_plane.h"

namespace mooncake {

class Event;
class Staging;
struct StagedOp;

class MooncakeCudaBackend final : public MooncakeBackend {
 public:
  // Device tensors must be on the CUDA device current when the group is made.
  MooncakeCudaBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                      std::chrono::milliseconds timeout,
                      c10::intrusive_ptr<MooncakeBackendOptions> options,
                      std::shared_ptr<TransferEngine> engine);

  static constexpr const char* kName = "mooncake";
  const std::string getBackendName() const override { return kName; }
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

  // Device plane (cuda_plane.h). Whether an op whose tensors are `tensors`
  // and whose input is `bytes` long runs on it: the decision depends only on
  // what every rank of the op shares (the group, the dtype, the size), so
  // that all of them take the same path.
  // `bytes` nullopt: an op whose inputs differ in size between ranks (any fits).
  bool on_plane(const std::vector<at::Tensor>& tensors, std::optional<size_t> bytes);
  // The same for a list form: `list` holds one tensor per rank of the world,
  // each with as many elements as `one`.
  bool on_plane_list(const at::Tensor& one, const std::vector<at::Tensor>& list,
                     std::optional<size_t> bytes);
  // On the op thread: `copy_in` queues this rank's input into its segment;
  // once it is there, `move(members, segments)` queues the op's reads of the
  // members' segments, among the members, until it succeeds (re-runs after
  // failures read the same segments); returns once the device has run it.
  void plane_run(
      OpType type, DType dtype, RedOp op, int root, uint64_t numel, int64_t timeout_ms,
      const std::function<void()>& copy_in,
      const std::function<void(const std::vector<int>&, const std::vector<const uint8_t*>&)>& move);
  // On the op thread: waits until the staging stream has run what is queued.
  void wait_stream();
  // all_to_all_single and all_to_all on the device plane (every rank's input
  // staged in regions of its segment, one per destination, in as many rounds
  // as the largest edge needs). `inputs` and `outputs` hold one tensor each
  // (slices at the counts' offsets) or one per rank of the world.
  void plane_all_to_all(const std::vector<at::Tensor>& inputs,
                        const std::vector<at::Tensor>& outputs,
                        const std::vector<size_t>& in_counts, const std::vector<size_t>& out_counts,
                        DType dtype, int64_t timeout_ms);
  // This rank's segment from `offset` bytes on, seen as a contiguous tensor
  // shaped like `like`.
  at::Tensor segment_as(const at::Tensor& like, size_t offset = 0);

  int device_ = -1;  // -1: this process sees no GPU (CPU tensors only)
  std::optional<c10::cuda::CUDAStream> stream_;
  at::Tensor user_active_;              // what active_ranks() returns
  std::unique_ptr<CudaPlane> plane_;    // null: every op is staged through the host
  size_t plane_min_bytes_ = 0;          // smaller inputs are staged
  std::shared_ptr<Event> stream_done_;  // wait_stream's event (made on its first call)
  // Inside a coalescing block: the staged ops whose results it brings back.
  bool staging_coalesced_ = false;
  std::vector<std::shared_ptr<StagedOp>> coalesced_;
};

}  // namespace mooncake
