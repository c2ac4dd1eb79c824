// The EP device path's binding: a workspace in device memory that same-host
// peers map (transport/cuda_ipc), and launches of the dispatch and combine
// kernels (src/kernels) on the caller's current stream. Python
// (mooncake/_ep_device.py) validates the arguments and keeps the call
// numbers; this file allocates the outputs and turns tensors into the launch
// structs. Nothing here waits for the device.
#include "kernels/api.h"
#include "torch/bindings.h"

namespace mooncake {
namespace {

// The launch phases, in every build, so Python names them in one place.
void register_ep_phases(pybind11::module_& m) {
  m.attr("EP_PHASE_SEND") = static_cast<int>(kernels::kSend);
  m.attr("EP_PHASE_RECV") = static_cast<int>(kernels::kRecv);
  m.attr("EP_PHASE_BOTH") = static_cast<int>(kernels::kBoth);
}

}  // namespace
}  // namespace mooncake

#if MOONCAKE_WITH_CUDA

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/error.h"
#include "ep/layout.h"
#include "kernels/api.h"
#include "transport/cuda_ipc.h"

namespace py = pybind11;

namespace mooncake {
namespace {

namespace k = kernels;

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw_error(ErrorKind::kSystem, -1, "EP device path: ", what, ": ", cudaGetErrorString(err));
}

void* ptr(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr() : nullptr;
}

// Outputs of earlier calls, handed out again once nothing else refers to them
// (no tensor, view or storage object: the pool's own reference is the last).
// Allocating them costs more host time than the launch itself on the GPU
// machine (12-25 us for a dispatch's six, one of them hundreds of MB), and a
// call's latency is mostly host time. The rules are the caching allocator's:
// a set is reused only on the stream it was last used on, so stream order
// keeps the old readers ahead of the new writer; and never while a stream is
// being captured, since a graph keeps writing into the memory it captured.
// Unlike the allocator, a recorded stream (record_stream) does not delay reuse.
//
// Callers get new tensors over the pool's storages, never the pool's own:
// a tensor that has met Python keeps a reference from its Python object
// after Python dropped it, so only the storage's count says who still holds
// the memory (views and storage objects included).
class OutputPool {
 public:
  using Key = std::array<int64_t, 6>;

  // A set of outputs: the pool's (handed out as new tensors over its
  // storages) or one the caller alone holds. The launch reads the pointers;
  // the tensors for the caller are made after it (host time before a launch
  // is latency, after it is overlap).
  class Taken {
   public:
    explicit Taken(const std::vector<at::Tensor>* pooled) : pooled_(pooled) {}
    explicit Taken(std::vector<at::Tensor> loose) : loose_(std::move(loose)) {}
    const std::vector<at::Tensor>& tensors() const { return pooled_ ? *pooled_ : loose_; }
    std::vector<at::Tensor> hand_out() { return pooled_ ? shared(*pooled_) : std::move(loose_); }

   private:
    const std::vector<at::Tensor>* pooled_ = nullptr;
    std::vector<at::Tensor> loose_;
  };

  template <typename Make>
  Taken take(const Key& key, cudaStream_t stream, Make make) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone)
      return Taken(make());
    for (auto& e : entries_)
      if (e.key == key && e.stream == stream && unused(e.tensors)) {
        e.last = ++clock_;
        ++hits_;
        return Taken(&e.tensors);
      }
    ++misses_;
    std::vector<at::Tensor> fresh = make();
    Entry* slot = nullptr;  // an empty place, else the least recently used unused set
    if (entries_.size() < kCapacity) {
      slot = &entries_.emplace_back();
    } else {
      for (auto& e : entries_)
        if (unused(e.tensors) && (slot == nullptr || e.last < slot->last)) slot = &e;
    }
    // Every set is in use: this one is the caller's alone.
    if (slot == nullptr) return Taken(std::move(fresh));
    *slot = Entry{key, stream, std::move(fresh), ++clock_};
    return Taken(&slot->tensors);
  }

  void clear() { entries_.clear(); }
  std::pair<int64_t, int64_t> stats() const { return {hits_, misses_}; }

 private:
  // Two calls in flight (double buffering), plus the other kind of call.
  static constexpr size_t kCapacity = 4;

  struct Entry {
    Key key{};
    cudaStream_t stream = nullptr;
    std::vector<at::Tensor> tensors;
    uint64_t last = 0;
  };

  static bool unused(const std::vector<at::Tensor>& tensors) {
    for (const auto& t : tensors)
      if (t.storage().use_count() != 1) return false;
    return true;
  }

  // New tensors over the same storages, sizes and strides.
  static std::vector<at::Tensor> shared(const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> out;
    out.reserve(tensors.size());
    for (const auto& t : tensors) {
      auto impl = c10::make_intrusive<c10::TensorImpl>(
          c10::Storage(t.storage()), c10::DispatchKeySet(c10::DispatchKey::CUDA), t.dtype());
      impl->set_sizes_and_strides(t.sizes(), t.strides());
      impl->set_storage_offset(t.storage_offset());
      out.emplace_back(std::move(impl));
    }
    return out;
  }

  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

class EpDevice {
 public:
  EpDevice(int64_t bytes, int64_t device)
      : device_(static_cast<int>(device)), workspace_(static_cast<size_t>(bytes), device_) {
    c10::cuda::CUDAGuard guard(device_);
    void* host = nullptr;
    cuda_check(cudaHostAlloc(&host, k::kStatusWords * sizeof(int32_t), cudaHostAllocMapped),
               "cudaHostAlloc of the status words");
    status_host_ = static_cast<int32_t*>(host);
    for (int i = 0; i < k::kStatusWords; ++i) status_host_[i] = 0;
    void* dev = nullptr;
    cuda_check(cudaHostGetDevicePointer(&dev, host, 0), "cudaHostGetDevicePointer");
    status_dev_ = static_cast<int32_t*>(dev);
    cuda_check(cudaMalloc(&grid_sync_, 2 * sizeof(uint32_t)), "cudaMalloc of the grid barrier");
    cuda_check(cudaMemset(grid_sync_, 0, 2 * sizeof(uint32_t)), "clearing the grid barrier");
    sm_count_ = device_sm_count(device_);
  }

  ~EpDevice() {
    c10::cuda::CUDAGuard guard(device_);
    cudaDeviceSynchronize();  // no kernel may still use the peers' mappings
    pool_.clear();
    maps_.clear();
    if (peers_ != nullptr) cudaFree(peers_);
    if (silent_ != nullptr) cudaFreeHost(silent_);
    cudaFree(grid_sync_);
    cudaFreeHost(status_host_);
  }

  py::bytes handle() const { return py::bytes(workspace_.handle()); }
  int64_t bytes() const { return static_cast<int64_t>(workspace_.size()); }
  int sm_count() const { return sm_count_; }
  std::string bus_id() const { return device_bus_id(device_); }

  // Sizes the peer table (a group's ranks, or an elastic buffer's capacity)
  // with this process at `rank` and no peer mapped. Waits for this device's
  // work first, so no kernel sees the table change under it.
  void reserve(int64_t capacity, int64_t rank) {
    MC_CHECK_ARG(capacity >= 1 && rank >= 0 && rank < capacity, "reserve: rank ", rank,
                 " is outside [0, ", capacity, ")");
    c10::cuda::CUDAGuard guard(device_);
    cuda_check(cudaDeviceSynchronize(), "waiting for the device before remapping");
    maps_.clear();
    maps_.resize(static_cast<size_t>(capacity));
    table_.assign(static_cast<size_t>(capacity), nullptr);
    table_[static_cast<size_t>(rank)] = workspace_.data();
    if (peers_ != nullptr) cudaFree(peers_);
    peers_ = nullptr;
    cuda_check(cudaMalloc(&peers_, capacity * sizeof(uint8_t*)), "cudaMalloc of the peer table");
    if (silent_ != nullptr) cudaFreeHost(silent_);
    silent_ = nullptr;
    void* host = nullptr;
    cuda_check(cudaHostAlloc(&host, capacity * sizeof(int32_t), cudaHostAllocMapped),
               "cudaHostAlloc of the silent-rank words");
    silent_ = static_cast<int32_t*>(host);
    for (int64_t r = 0; r < capacity; ++r) silent_[r] = 0;
    void* dev = nullptr;
    cuda_check(cudaHostGetDevicePointer(&dev, host, 0), "cudaHostGetDevicePointer");
    silent_dev_ = static_cast<int32_t*>(dev);
    num_ranks_ = capacity;
    rank_ = rank;
    write_table(0, capacity);
  }

  // Maps `slot`'s workspace from its exported handle, staged: kernels do not
  // see it before publish_peer. False when it cannot be mapped (its process
  // is gone, or on another host).
  bool map_peer(int64_t slot, const std::string& handle) {
    check_peer_slot(slot, "map_peer");
    MC_CHECK_ARG(maps_[slot] == nullptr, "map_peer: slot ", slot, " is mapped already");
    c10::cuda::CUDAGuard guard(device_);
    try {
      maps_[slot] = std::make_unique<PeerMapping>(handle, device_);
      return true;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kPeerFailed) throw;
      return false;
    }
  }

  // Puts a mapped slot into the kernels' table, after this device's earlier
  // work (no kernel sees a half-connected slot).
  void publish_peer(int64_t slot) {
    check_peer_slot(slot, "publish_peer");
    MC_CHECK_ARG(maps_[slot] != nullptr, "publish_peer: slot ", slot, " is not mapped");
    c10::cuda::CUDAGuard guard(device_);
    cuda_check(cudaDeviceSynchronize(), "waiting for the device before publishing a peer");
    table_[slot] = maps_[slot]->data();
    write_table(slot, 1);
  }

  // Takes a slot out of the table and releases its mapping, after this
  // device's earlier work.
  void unmap_peer(int64_t slot) {
    check_peer_slot(slot, "unmap_peer");
    c10::cuda::CUDAGuard guard(device_);
    cuda_check(cudaDeviceSynchronize(), "waiting for the device before unmapping a peer");
    table_[slot] = nullptr;
    write_table(slot, 1);
    maps_[slot].reset();
  }

  // Maps rank r's workspace from handles[r] ("" for a rank not to map: one on
  // another host, or absent); `rank` is this process's. Returns, per rank,
  // whether it is reachable.
  std::vector<bool> connect(const std::vector<std::string>& handles, int64_t rank) {
    const auto R = static_cast<int64_t>(handles.size());
    MC_CHECK_ARG(rank >= 0 && rank < R, "connect: rank ", rank, " is outside [0, ", R, ")");
    reserve(R, rank);
    std::vector<bool> reachable(static_cast<size_t>(R), false);
    reachable[rank] = true;
    for (int64_t r = 0; r < R; ++r) {
      if (r == rank || handles[r].empty() || !map_peer(r, handles[r])) continue;
      table_[r] = maps_[r]->data();
      reachable[r] = true;
    }
    write_table(0, R);
    return reachable;
  }

  // The ranks kernels masked for silence since the last call (and forgets them).
  std::vector<int64_t> take_silent() {
    std::vector<int64_t> out;
    for (int64_t r = 0; r < num_ranks_; ++r)
      if (reinterpret_cast<volatile int32_t*>(silent_)[r] != 0) {
        silent_[r] = 0;
        out.push_back(r);
      }
    return out;
  }

  // Launches `phases` of a dispatch. Its outputs are [recv_x, recv_scales
  // (empty without FP8), recv_count, src_info, layout_range]:
  // taken here on the current stream when `outputs` is None (the first launch
  // of a call), else those of the call's first launch.
  std::vector<at::Tensor> dispatch(const at::Tensor& x_arg, const at::Tensor& topk_arg,
                                   const at::Tensor& active_ranks,
                                   const std::optional<at::Tensor>& slot_mask,
                                   const std::optional<at::Tensor>& stats,
                                   const std::optional<std::vector<at::Tensor>>& outputs,
                                   int64_t max_tokens, int64_t num_experts, int64_t ranks,
                                   int64_t seq, int64_t timeout_ns, bool use_fp8, int64_t phases,
                                   int64_t num_blocks) {
    const at::Tensor x = x_arg.contiguous(), topk_idx = topk_arg.contiguous();
    k::DispatchArgs a{};
    a.c = common(max_tokens, x.size(1), num_experts, ranks, seq, active_ranks, slot_mask,
                 timeout_ns, phases, num_blocks, "dispatch");
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_).stream();
    OutputPool::Taken taken =
        outputs ? OutputPool::Taken(*outputs) : allocate(x, a.c.layout, use_fp8, stream);
    const std::vector<at::Tensor>& o = taken.tensors();
    MC_CHECK_ARG(o.size() == 5, "dispatch: outputs must be the 5 tensors of the first launch");
    a.x = x.data_ptr();
    a.x_dtype = dtype_of(x, "dispatch");
    a.num_tokens = x.size(0);
    a.topk_idx = topk_idx.data_ptr();
    a.topk_int64 = topk_idx.scalar_type() == at::kLong;
    a.topk = static_cast<int32_t>(topk_idx.size(1));
    a.use_fp8 = use_fp8;
    a.recv_x = o[0].data_ptr();
    a.recv_scales = use_fp8 ? o[1].data_ptr<float>() : nullptr;
    a.recv_count = o[2].data_ptr<int32_t>();
    a.src_info = o[3].data_ptr<int32_t>();
    a.layout_range = o[4].data_ptr<int64_t>();
    a.stats = static_cast<int32_t*>(ptr(stats));
    k::launch_dispatch(a, stream);
    return taken.hand_out();
  }

  // Launches `phases` of a combine into `out` ([N, H] of x's dtype; taken
  // here when None) and returns it.
  at::Tensor combine(const at::Tensor& x_arg, const at::Tensor& layout_range,
                     const at::Tensor& topk_arg, const at::Tensor& weights_arg,
                     const at::Tensor& active_ranks, const std::optional<at::Tensor>& slot_mask,
                     const std::optional<at::Tensor>& out_arg, int64_t max_tokens,
                     int64_t num_experts, int64_t ranks, int64_t seq, int64_t timeout_ns,
                     int64_t phases, int64_t num_blocks) {
    const at::Tensor x = x_arg.contiguous(), topk_idx = topk_arg.contiguous();
    // (.to() goes through the dispatcher even when it has nothing to do.)
    const at::Tensor topk_weights =
        (weights_arg.scalar_type() == at::kFloat ? weights_arg : weights_arg.to(at::kFloat))
            .contiguous();
    k::CombineArgs a{};
    a.c = common(max_tokens, x.size(2), num_experts, ranks, seq, active_ranks, slot_mask,
                 timeout_ns, phases, num_blocks, "combine");
    a.x = x.data_ptr();
    a.x_dtype = dtype_of(x, "combine");
    a.layout_range = layout_range.data_ptr<int64_t>();
    a.num_tokens = topk_idx.size(0);
    a.topk_idx = topk_idx.data_ptr();
    a.topk_int64 = topk_idx.scalar_type() == at::kLong;
    a.topk = static_cast<int32_t>(topk_idx.size(1));
    a.topk_weights = topk_weights.data_ptr<float>();
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_).stream();
    const int64_t n = topk_idx.size(0), h = x.size(2);
    if (out_arg) {
      a.out = out_arg->data_ptr();
      k::launch_combine(a, stream);
      return *out_arg;
    }
    OutputPool::Taken taken =
        pool_.take({kCombineOut, n, h, static_cast<int64_t>(x.scalar_type()), 0, 0}, stream,
                   [&] { return std::vector{at::empty({n, h}, x.options())}; });
    a.out = taken.tensors().front().data_ptr();
    k::launch_combine(a, stream);
    return taken.hand_out().front();
  }

  // The rows region of call `seq`'s half as a [E/R, R*T, H] tensor of
  // `dtype` (bfloat16 or float16): the zero-copy combine buffer, whose rows the
  // token owners read in place. It does not own the memory: it is valid while
  // this workspace lives.
  at::Tensor combine_buffer(int64_t max_tokens, int64_t hidden, int64_t num_experts, int64_t ranks,
                            int64_t seq, const at::Tensor& like) {
    const char* what = "get_next_combine_buffer";
    const EpLayout l = layout(max_tokens, hidden, num_experts, ranks, what);
    dtype_of(like, what);
    MC_CHECK_ARG(hidden % 8 == 0, what, ": hidden must be a multiple of 8, got ", hidden);
    MC_CHECK_ARG(seq >= 1, what, ": seq must be >= 1");
    return at::from_blob(workspace_.data() + l.expert_row(static_cast<uint64_t>(seq), 0),
                         {l.local_experts, ranks * max_tokens, hidden},
                         at::TensorOptions().dtype(like.scalar_type()).device(at::kCUDA, device_));
  }

  // (hits, misses) of the output pool so far: how often a call found its
  // outputs free for reuse.
  std::pair<int64_t, int64_t> pool_stats() const { return pool_.stats(); }

  // The first status word: 0 while no kernel has reported anything.
  int32_t status_code() const { return *static_cast<volatile int32_t*>(status_host_); }

  // The status words as the device last wrote them (read without a sync);
  // `clear` resets them for the next report.
  std::vector<int32_t> status(bool clear) {
    std::vector<int32_t> out(status_host_, status_host_ + k::kStatusWords);
    if (clear)
      for (int i = 0; i < k::kStatusWords; ++i) status_host_[i] = 0;
    return out;
  }

 private:
  // The layout of a call's shape, checked against this workspace.
  EpLayout layout(int64_t T, int64_t H, int64_t E, int64_t R, const char* what) const {
    MC_CHECK_ARG(peers_ != nullptr, what, ": the EP device path is not connected");
    MC_CHECK_ARG(R > rank_ && R <= num_ranks_, what, ": a call covers ", R,
                 " ranks; it must cover this one (", rank_, ") and at most the table's ",
                 num_ranks_);
    EpLayout l(EpShape{T, H, R, E});
    // Rows are numbered in int32 on the device (a combine flag carries one).
    MC_CHECK_ARG(E * T < (int64_t{1} << 31), what,
                 ": num_experts * num_max_dispatch_tokens_per_rank",
                 " must be below 2^31 on the device path, got ", E * T);
    MC_CHECK_ARG(l.total_bytes <= workspace_.size(), what, ": the call needs ", l.total_bytes,
                 " workspace bytes, the buffer has ", workspace_.size());
    return l;
  }

  k::Common common(int64_t T, int64_t H, int64_t E, int64_t R, int64_t seq,
                   const at::Tensor& active, const std::optional<at::Tensor>& slot_mask,
                   int64_t timeout_ns, int64_t phases, int64_t num_blocks, const char* what) {
    k::Common c{};
    c.layout = layout(T, H, E, R, what);
    MC_CHECK_ARG(active.is_cuda() && active.scalar_type() == at::kInt && active.numel() == R &&
                     active.is_contiguous(),
                 what, ": active_ranks must be a contiguous CUDA int32 tensor of ", R, " ranks");
    MC_CHECK_ARG(!slot_mask || (slot_mask->is_cuda() && slot_mask->scalar_type() == at::kInt &&
                                slot_mask->numel() >= R && slot_mask->is_contiguous()),
                 what, ": slot_mask must be a contiguous CUDA int32 tensor of at least ", R,
                 " slots");
    MC_CHECK_ARG(seq >= 1, what, ": seq must be >= 1");
    MC_CHECK_ARG(timeout_ns > 0, what, ": timeout_ns must be > 0");
    MC_CHECK_ARG(phases >= k::kSend && phases <= k::kBoth, what, ": phases must be 1, 2 or 3");
    MC_CHECK_ARG(num_blocks >= 1 && num_blocks <= sm_count_, what, ": num_blocks must be in [1, ",
                 sm_count_, "]");
    c.peers = peers_;
    c.rank = static_cast<int32_t>(rank_);
    c.seq = static_cast<uint64_t>(seq);
    c.active_ranks = active.data_ptr<int32_t>();
    c.slot_mask = slot_mask ? slot_mask->data_ptr<int32_t>() : nullptr;
    c.silent = silent_dev_;
    c.timeout_ns = timeout_ns;
    c.status = status_dev_;
    c.grid_sync = grid_sync_;
    c.phases = static_cast<int32_t>(phases);
    c.num_blocks = static_cast<int32_t>(num_blocks);
    return c;
  }

  OutputPool::Taken allocate(const at::Tensor& x, const EpLayout& l, bool use_fp8,
                             cudaStream_t stream) {
    const int64_t epr = l.local_experts, cols = l.shape.num_ranks * l.shape.max_tokens;
    const int64_t H = l.shape.hidden;
    const auto dtype = use_fp8 ? at::kFloat8_e4m3fn : x.scalar_type();
    return pool_.take(
        {kDispatchOut, epr, cols, H, static_cast<int64_t>(dtype), l.shape.num_ranks}, stream, [&] {
          const auto opts = x.options();
          return std::vector<at::Tensor>{
              at::empty({epr, cols, H}, opts.dtype(dtype)),
              at::empty({use_fp8 ? epr : 0, cols, H / EpLayout::kFp8Block}, opts.dtype(at::kFloat)),
              at::empty({epr}, opts.dtype(at::kInt)),
              at::empty({epr, cols}, opts.dtype(at::kInt)),
              at::empty({epr, l.shape.num_ranks}, opts.dtype(at::kLong)),
          };
        });
  }

  enum : int64_t { kDispatchOut = 1, kCombineOut = 2 };

  static k::Dtype dtype_of(const at::Tensor& x, const char* what) {
    if (x.scalar_type() == at::kBFloat16) return k::Dtype::kBf16;
    MC_CHECK_ARG(x.scalar_type() == at::kHalf, what,
                 ": x must be bfloat16 or float16 on the "
                 "device path, got ",
                 c10::toString(x.scalar_type()));
    return k::Dtype::kFp16;
  }

  void check_peer_slot(int64_t slot, const char* what) const {
    MC_CHECK_ARG(slot >= 0 && slot < num_ranks_ && slot != rank_, what, ": slot ", slot,
                 " must be in [0, ", num_ranks_, ") and not this process's (", rank_, ")");
  }

  // Copies table_[first, first + n) to the device's peer table.
  void write_table(int64_t first, int64_t n) {
    cuda_check(cudaMemcpy(peers_ + first, table_.data() + first, n * sizeof(uint8_t*),
                          cudaMemcpyHostToDevice),
               "copying the peer table");
  }

  int device_;
  DeviceSegment workspace_;
  std::vector<std::unique_ptr<PeerMapping>> maps_;  // per slot; null: not mapped
  std::vector<uint8_t*> table_;                     // what the device's table holds
  uint8_t** peers_ = nullptr;
  int32_t* silent_ = nullptr;  // host-mapped [num_ranks_]
  int32_t* silent_dev_ = nullptr;
  int64_t num_ranks_ = 0;
  int64_t rank_ = 0;
  int32_t* status_host_ = nullptr;
  int32_t* status_dev_ = nullptr;
  uint32_t* grid_sync_ = nullptr;
  int sm_count_ = 0;
  OutputPool pool_;
};

}  // namespace

void register_ep_device(py::module_& m) {
  py::class_<EpDevice>(m, "EpDevice",
                       "The EP device path's workspace, its peers' mappings and the kernels' "
                       "launches (mooncake/_ep_device.py drives it).")
      .def(py::init<int64_t, int64_t>(), py::arg("bytes"), py::arg("device"))
      .def("handle", &EpDevice::handle)
      .def_property_readonly("bytes", &EpDevice::bytes)
      .def_property_readonly("sm_count", &EpDevice::sm_count)
      .def_property_readonly("bus_id", &EpDevice::bus_id)
      .def("connect", &EpDevice::connect, py::arg("handles"), py::arg("rank"),
           py::call_guard<py::gil_scoped_release>())
      .def("reserve", &EpDevice::reserve, py::arg("capacity"), py::arg("rank"),
           py::call_guard<py::gil_scoped_release>())
      .def("map_peer", &EpDevice::map_peer, py::arg("slot"), py::arg("handle"),
           py::call_guard<py::gil_scoped_release>())
      .def("publish_peer", &EpDevice::publish_peer, py::arg("slot"),
           py::call_guard<py::gil_scoped_release>())
      .def("unmap_peer", &EpDevice::unmap_peer, py::arg("slot"),
           py::call_guard<py::gil_scoped_release>())
      .def("take_silent", &EpDevice::take_silent)
      .def("dispatch", &EpDevice::dispatch, py::arg("x"), py::arg("topk_idx"),
           py::arg("active_ranks"), py::arg("slot_mask"), py::arg("stats"), py::arg("outputs"),
           py::arg("max_tokens"), py::arg("num_experts"), py::arg("ranks"), py::arg("seq"),
           py::arg("timeout_ns"), py::arg("use_fp8"), py::arg("phases"), py::arg("num_blocks"))
      .def("combine", &EpDevice::combine, py::arg("x"), py::arg("layout_range"),
           py::arg("topk_idx"), py::arg("topk_weights"), py::arg("active_ranks"),
           py::arg("slot_mask"), py::arg("out"), py::arg("max_tokens"), py::arg("num_experts"),
           py::arg("ranks"), py::arg("seq"), py::arg("timeout_ns"), py::arg("phases"),
           py::arg("num_blocks"))
      .def("combine_buffer", &EpDevice::combine_buffer, py::arg("max_tokens"), py::arg("hidden"),
           py::arg("num_experts"), py::arg("ranks"), py::arg("seq"), py::arg("like"))
      .def("status", &EpDevice::status, py::arg("clear") = false)
      .def("status_code", &EpDevice::status_code)
      .def("pool_stats", &EpDevice::pool_stats);
  register_ep_phases(m);
}

}  // namespace mooncake

#else  // a CPU build: no device path (Python sees no EpDevice and runs the portable one)

namespace mooncake {
void register_ep_device(pybind11::module_& m) {
  register_ep_phases(m);
}
}  // namespace mooncake

#endif
