// The EP device path's binding: the device library's EP buffer (device/ep.h)
// for tensors. Python (mooncake/ep/device.py) validates the arguments and
// keeps the call numbers; this file allocates the outputs (reusing them
// where it can) and turns tensors into the launch structs. Nothing here
// waits for the device.
#include "kernels/api.h"
#include "torch/bindings.h"

namespace mooncake {
namespace {

// The launch phases and the silent-peer status, in every build, so Python names them in
// one place.
void register_ep_phases(pybind11::module_& m) {
  m.attr("EP_PHASE_SEND") = static_cast<int>(kernels::kSend);
  m.attr("EP_PHASE_RECV") = static_cast<int>(kernels::kRecv);
  m.attr("EP_PHASE_BOTH") = static_cast<int>(kernels::kBoth);
  m.attr("EP_STATUS_SILENT_PEER") = static_cast<int>(kernels::kStatusSilentPeer);
  m.attr("EP_STATUS_LEFT_OUT") = static_cast<int>(kernels::kStatusLeftOut);
  m.attr("EP_MASKED_SILENT") = static_cast<int>(kernels::kMaskedSilent);
  m.attr("EP_MASKED_LOST") = static_cast<int>(kernels::kMaskedLost);
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
#include "device/ep.h"
#include "ep/layout.h"
#include "kernels/api.h"

namespace py = pybind11;

namespace mooncake {
namespace {

namespace k = kernels;

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

// Tensors to the device library's EP buffer (device/ep.h): checks what only
// tensors have (device, dtype, layout), takes the outputs and launches on the
// caller's current stream.
class EpDevice {
 public:
  EpDevice(int64_t bytes, int64_t device)
      : ep_(static_cast<size_t>(bytes), static_cast<int>(device)) {}

  ~EpDevice() {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(ep_.device()));
    cudaDeviceSynchronize();  // the pool's outputs may still be written
    pool_.clear();
  }

  EpBuffer& ep() { return ep_; }
  py::bytes card() const { return py::bytes(ep_.card()); }

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
    const EpCall call = call_of(max_tokens, x.size(1), num_experts, ranks, seq, active_ranks,
                                slot_mask, timeout_ns, phases, num_blocks, "dispatch");
    const cudaStream_t stream = current_stream();
    OutputPool::Taken taken =
        outputs ? OutputPool::Taken(*outputs)
                : allocate(x, EpLayout(EpShape{max_tokens, x.size(1), ranks, num_experts}), use_fp8,
                           stream);
    const std::vector<at::Tensor>& o = taken.tensors();
    MC_CHECK_ARG(o.size() == 5, "dispatch: outputs must be the 5 tensors of the first launch");
    k::DispatchArgs a{};
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
    ep_.dispatch(call, a, stream);
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
    const EpCall call = call_of(max_tokens, x.size(2), num_experts, ranks, seq, active_ranks,
                                slot_mask, timeout_ns, phases, num_blocks, "combine");
    k::CombineArgs a{};
    a.x = x.data_ptr();
    a.x_dtype = dtype_of(x, "combine");
    a.layout_range = layout_range.data_ptr<int64_t>();
    a.num_tokens = topk_idx.size(0);
    a.topk_idx = topk_idx.data_ptr();
    a.topk_int64 = topk_idx.scalar_type() == at::kLong;
    a.topk = static_cast<int32_t>(topk_idx.size(1));
    a.topk_weights = topk_weights.data_ptr<float>();
    const cudaStream_t stream = current_stream();
    const int64_t n = topk_idx.size(0), h = x.size(2);
    if (out_arg) {
      a.out = out_arg->data_ptr();
      ep_.combine(call, a, stream);
      return *out_arg;
    }
    OutputPool::Taken taken =
        pool_.take({kCombineOut, n, h, static_cast<int64_t>(x.scalar_type()), 0, 0}, stream,
                   [&] { return std::vector{at::empty({n, h}, x.options())}; });
    a.out = taken.tensors().front().data_ptr();
    ep_.combine(call, a, stream);
    return taken.hand_out().front();
  }

  // The rows region of call `seq`'s half as a [E/R, R*T, H] tensor of
  // `like`'s dtype (bfloat16 or float16): the zero-copy combine buffer, whose
  // rows the token owners read in place. It does not own the memory: it is
  // valid while this workspace lives.
  at::Tensor combine_buffer(int64_t max_tokens, int64_t hidden, int64_t num_experts, int64_t ranks,
                            int64_t seq, const at::Tensor& like) {
    const char* what = "get_next_combine_buffer";
    dtype_of(like, what);
    uint8_t* rows =
        ep_.combine_rows(max_tokens, hidden, num_experts, ranks, static_cast<uint64_t>(seq), what);
    return at::from_blob(
        rows, {num_experts / ranks, ranks * max_tokens, hidden},
        at::TensorOptions().dtype(like.scalar_type()).device(at::kCUDA, ep_.device()));
  }

  // (hits, misses) of the output pool so far: how often a call found its
  // outputs free for reuse.
  std::pair<int64_t, int64_t> pool_stats() const { return pool_.stats(); }

 private:
  cudaStream_t current_stream() const {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ep_.device())).stream();
  }

  EpCall call_of(int64_t T, int64_t H, int64_t E, int64_t R, int64_t seq, const at::Tensor& active,
                 const std::optional<at::Tensor>& slot_mask, int64_t timeout_ns, int64_t phases,
                 int64_t num_blocks, const char* what) const {
    MC_CHECK_ARG(active.is_cuda() && active.scalar_type() == at::kInt && active.numel() == R &&
                     active.is_contiguous(),
                 what, ": active_ranks must be a contiguous CUDA int32 tensor of ", R, " ranks");
    MC_CHECK_ARG(!slot_mask || (slot_mask->is_cuda() && slot_mask->scalar_type() == at::kInt &&
                                slot_mask->numel() >= R && slot_mask->is_contiguous()),
                 what, ": slot_mask must be a contiguous CUDA int32 tensor of at least ", R,
                 " slots");
    MC_CHECK_ARG(seq >= 1, what, ": seq must be >= 1");
    MC_CHECK_ARG(num_blocks >= 1, what, ": num_blocks must be >= 1");
    EpCall c;
    c.max_tokens = T;
    c.hidden = H;
    c.num_experts = E;
    c.ranks = R;
    c.seq = static_cast<uint64_t>(seq);
    c.timeout_ns = timeout_ns;
    c.phases = static_cast<int32_t>(phases);
    c.num_blocks = static_cast<int32_t>(std::min<int64_t>(num_blocks, INT32_MAX));
    c.active_ranks = active.data_ptr<int32_t>();
    c.slot_mask = slot_mask ? slot_mask->data_ptr<int32_t>() : nullptr;
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
              // Token stride 1, as upstream's (FP8 grouped GEMMs read scales so);
              // strided, not a transpose: a view keeps its base, and the pool
              // reuses a set only when its own reference is the last.
              at::empty_strided({use_fp8 ? epr : 0, cols, H / EpLayout::kFp8Block},
                                {H / EpLayout::kFp8Block * cols, 1, cols}, opts.dtype(at::kFloat)),
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

  EpBuffer ep_;
  OutputPool pool_;
};

}  // namespace

void register_ep_device(py::module_& m) {
  // The GIL is released where a call may wait for the device (the peer table's changes).
  using R = py::call_guard<py::gil_scoped_release>;
  // Held by shared_ptr: a workspace() view's storage keeps its EpDevice alive.
  py::class_<EpDevice, std::shared_ptr<EpDevice>>(
      m, "EpDevice",
      "The EP device path's buffer (src/device/ep.h): its workspace, its peers' "
      "mappings and the kernels' launches (mooncake/ep/device.py drives it).")
      .def(py::init<int64_t, int64_t>(), py::arg("bytes"), py::arg("device"))
      .def("card", &EpDevice::card)
      .def(
          "shares_gpu",
          [](EpDevice& d, const std::string& card) { return d.ep().shares_gpu(card); },
          py::arg("card"))
      .def_property_readonly("bytes",
                             [](EpDevice& d) { return static_cast<int64_t>(d.ep().bytes()); })
      .def("workspace",
           [](const std::shared_ptr<EpDevice>& d) {
             // The whole workspace as uint8 [bytes], without a copy. Its storage holds
             // the EpDevice, so no view outlives the memory it shows.
             const auto opts =
                 at::TensorOptions().dtype(at::kByte).device(at::kCUDA, d->ep().device());
             return at::from_blob(
                 d->ep().workspace(), {static_cast<int64_t>(d->ep().bytes())},
                 [keep = d](void*) mutable { keep.reset(); }, opts);
           })
      .def_property_readonly("sm_count", [](EpDevice& d) { return d.ep().sm_count(); })
      .def_property_readonly("num_blocks", [](EpDevice& d) { return d.ep().num_blocks(); })
      .def(
          "share_gpu", [](EpDevice& d, int processes) { d.ep().share_gpu(processes); },
          py::arg("processes"))
      .def(
          "connect",
          [](EpDevice& d, const std::vector<std::string>& cards, int64_t rank, uint32_t key) {
            auto c = d.ep().connect(cards, rank, key);
            return std::make_pair(c.reachable, c.present);
          },
          py::arg("cards"), py::arg("rank"), py::arg("key"), R())
      .def(
          "reserve",
          [](EpDevice& d, int64_t capacity, int64_t rank, uint32_t key) {
            d.ep().reserve(capacity, rank, key);
          },
          py::arg("capacity"), py::arg("rank"), py::arg("key"), R())
      .def(
          "map_peer",
          [](EpDevice& d, int64_t slot, const std::string& card, uint32_t key) {
            return d.ep().map_peer(slot, card, key);
          },
          py::arg("slot"), py::arg("card"), py::arg("key"), R())
      .def(
          "publish_peer", [](EpDevice& d, int64_t slot) { d.ep().publish_peer(slot); },
          py::arg("slot"), R())
      .def(
          "unmap_peer", [](EpDevice& d, int64_t slot) { d.ep().unmap_peer(slot); }, py::arg("slot"),
          R())
      .def(
          "fence_peer", [](EpDevice& d, int64_t slot) { d.ep().fence_peer(slot); }, py::arg("slot"),
          R())
      .def_property_readonly("left_out", [](EpDevice& d) { return d.ep().left_out(); })
      .def("take_masked", [](EpDevice& d) { return d.ep().take_masked(); })
      .def("lost_listener",
           // For whoever watches the peers (MooncakeBackend/ElasticPeers.watch_peers): sets
           // the kernels' lost words of the current peer table (a connect or reserve
           // renews them, and the listeners made before stop: watch again then).
           [](EpDevice& d) { return LossListenerBox{set_lost(d.ep().lost_words())}; })
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
      .def(
          "status", [](EpDevice& d, bool clear) { return d.ep().status(clear); },
          py::arg("clear") = false)
      .def("status_code", [](EpDevice& d) { return d.ep().status_code(); })
      .def(
          "raise_reported",
          [](EpDevice& d, const std::string& what) { d.ep().raise_reported(what.c_str()); },
          py::arg("what"))
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
