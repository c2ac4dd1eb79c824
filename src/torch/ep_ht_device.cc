// The ElasticBuffer's device path binding: the device library's
// high-throughput EP buffer (device/ep_ht.h) for tensors. Python
// (mooncake/ep/throughput_device.py) checks the arguments, keeps the call
// numbers and builds the handles; this file allocates the plan and the
// outputs and turns tensors into the launch structs. Nothing here waits for
// the device.
#include "torch/bindings.h"

#if MOONCAKE_WITH_CUDA

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "device/cuda.h"
#include "device/ep_ht.h"
#include "kernels/ep_ht/api.h"

namespace py = pybind11;

namespace mooncake {
namespace {

namespace ht = kernels::ep_ht;

// A fresh dispatch's routing as the kernels keep it (int32 arrays on the
// device, all in one allocation), held by its EPHandle for cached dispatches
// and combine. The tensors are the handle's fields; the kernels' own arrays
// are pointers into `block` (a tensor view costs host time on every call).
struct HtPlanTensors {
  at::Tensor block;     // every array below
  at::Tensor topk;      // the dispatch's topk_idx [N, K] (the handle's copy)
  at::Tensor metadata;  // recv_src_metadata [R * T, K + 2]
  at::Tensor dst_slot;  // dst_buffer_slot_idx [N, K]
  at::Tensor psum_rank, psum_expert, unaligned;  // [R], [E/R], [E/R]
  int32_t* chunk_tab = nullptr;                  // [R (+ E expanding), chunks]
  int32_t* inpos = nullptr;                      // [N, K]
  int32_t* inrank = nullptr;                     // [N, K] expanding, else [1]
  int32_t* words = nullptr;                      // ht::HtPlan
  int64_t num_words = 0;
  int64_t num_experts = 0, max_tokens = 0, alignment = 1, chunk_tokens = 1, num_chunks = 0;
  bool expand = false;

  ht::HtRouting routing() const { return routing(topk); }
  // The routing over `entries` ([N, K] topk_idx): the plan's own copy, or in
  // the layout pass (before that copy's view is made) the caller's, which
  // the pass copies into it.
  ht::HtRouting routing(const at::Tensor& entries) const {
    ht::HtRouting r;
    r.topk_idx = entries.data_ptr();
    r.topk_int64 = entries.scalar_type() == at::kLong;
    r.num_tokens = entries.size(0);
    r.topk = static_cast<int32_t>(entries.size(1));
    r.num_experts = num_experts;
    r.max_tokens = max_tokens;
    r.chunk_tokens = chunk_tokens;
    r.num_chunks = num_chunks;
    r.chunk_tab = chunk_tab;
    r.inpos = inpos;
    r.inrank = inrank;
    r.plan = words;
    return r;
  }
};

class EpHtDevice {
 public:
  EpHtDevice(int64_t ranks, int64_t rank, int64_t channels, int64_t ring_bytes, int64_t device)
      : buf_(ranks, rank, channels, static_cast<size_t>(ring_bytes), static_cast<int>(device)) {}

  EpHtBuffer& buf() { return buf_; }

  // Slots per ring a call of these rows would get (0: they do not fit).
  int64_t dispatch_slots(int64_t topk, bool weights, bool expand, int64_t data_bytes,
                         int64_t scale_bytes) const {
    return ht::HtSlots::dispatch(buf_.layout(), static_cast<int32_t>(topk), weights, expand,
                                 data_bytes, scale_bytes)
        .count;
  }
  int64_t combine_slots(int64_t topk, bool weights, int64_t data_bytes) const {
    return ht::HtSlots::combine(buf_.layout(), static_cast<int32_t>(topk), weights, data_bytes)
        .count;
  }

  // A fresh dispatch's layout pass and notify exchange: the plan, which holds
  // its own copy of `topk` (the handle's: the caller may reuse its tensor).
  std::shared_ptr<HtPlanTensors> layout(const at::Tensor& topk, const at::Tensor& active,
                                        int64_t max_tokens, int64_t num_experts, int64_t alignment,
                                        bool expand, int64_t signature, int64_t seq,
                                        int64_t timeout_ns, int64_t blocks) {
    const char* what = "dispatch";
    check_stamps(std::max<int64_t>(blocks, 1), what, 1);  // (launch_layout's grid is >= 1)
    check_index(topk, what);
    check_active(active, what);
    const int64_t R = buf_.ranks(), N = topk.size(0), K = topk.size(1);
    MC_CHECK_ARG(K >= 1 && K <= ht::kMaxTopk, what, ": num_topk must be in [1, ", ht::kMaxTopk,
                 "], got ", K);
    MC_CHECK_ARG(N <= max_tokens, what, ": ", N, " tokens, more than num_max_tokens_per_rank (",
                 max_tokens, ")");
    MC_CHECK_ARG(R * max_tokens < (int64_t{1} << 31), what,
                 ": ranks * num_max_tokens_per_rank must be below 2^31, got ", R * max_tokens);
    MC_CHECK_ARG(alignment >= 1, what, ": expert_alignment must be >= 1");
    auto plan = std::make_shared<HtPlanTensors>();
    plan->num_experts = num_experts;
    plan->max_tokens = max_tokens;
    plan->alignment = alignment;
    plan->expand = expand;
    plan->chunk_tokens = std::max<int64_t>(1, ht::kThreads / K);
    plan->num_chunks = (N + plan->chunk_tokens - 1) / plan->chunk_tokens;
    const int64_t epr = num_experts / R;
    // The plan's int32 arrays and its copy of `topk` in one allocation (each
    // an allocator call otherwise), each at a 16-byte boundary; the kernel is
    // queued before the handle's tensor views are made.
    enum Part { kTopk, kTab, kInpos, kInrank, kWords, kMeta, kDst, kPsumR, kPsumE, kUnal, kParts };
    const int64_t words[kParts] = {
        N * K * static_cast<int64_t>(topk.element_size()) / 4,
        (R + (expand ? num_experts : 0)) * std::max<int64_t>(plan->num_chunks, 1),
        N * K,
        expand ? N * K : 1,
        ht::HtPlan(R, epr, buf_.channels()).words(),
        R * max_tokens * (K + 2),
        N * K,
        R,
        epr,
        epr};
    int64_t offset[kParts], total = 0;
    for (int p = 0; p < kParts; ++p) {
      offset[p] = total;
      total += (words[p] + 3) / 4 * 4;
    }
    plan->block = at::empty({total}, topk.options().dtype(at::kInt));
    int32_t* base = plan->block.data_ptr<int32_t>();
    plan->chunk_tab = base + offset[kTab];
    plan->inpos = base + offset[kInpos];
    plan->inrank = base + offset[kInrank];
    plan->words = base + offset[kWords];
    plan->num_words = words[kWords];
    ht::LayoutArgs a;
    a.r = plan->routing(topk);
    a.topk_copy = base + offset[kTopk];
    a.alignment = alignment;
    a.expand = expand;
    a.signature = static_cast<uint32_t>(signature);
    a.psum_rank = base + offset[kPsumR];
    a.psum_expert = base + offset[kPsumE];
    a.unaligned = base + offset[kUnal];
    buf_.layout(a, static_cast<uint64_t>(seq), timeout_ns, active.data_ptr<int32_t>(),
                static_cast<int>(blocks), stream());
    const auto part = [&](Part p, at::IntArrayRef shape) {
      return plan->block.narrow(0, offset[p], words[p]).view(shape);
    };
    plan->topk = part(kTopk, {words[kTopk]}).view(topk.scalar_type()).view({N, K});
    plan->metadata = part(kMeta, {R * max_tokens, K + 2});
    plan->dst_slot = part(kDst, {N, K});
    plan->psum_rank = part(kPsumR, {R});
    plan->psum_expert = part(kPsumE, {epr});
    plan->unaligned = part(kUnal, {epr});
    return plan;
  }

  // A dispatch along `plan` (after its layout pass, or cached): [recv_x,
  // recv_scales, recv_topk_idx, recv_topk_weights], the absent ones empty.
  std::vector<at::Tensor> dispatch(HtPlanTensors& plan, const at::Tensor& x,
                                   const std::optional<at::Tensor>& scales,
                                   const std::optional<at::Tensor>& weights,
                                   const at::Tensor& active, int64_t rows_alloc, int64_t exp_alloc,
                                   bool cached, bool trimmed, int64_t seq, int64_t timeout_ns,
                                   int64_t blocks) {
    const char* what = "dispatch";
    check_stamps(blocks, what);
    check_active(active, what);
    const int64_t N = plan.topk.size(0), K = plan.topk.size(1), H = x.size(1);
    check_rows(x, N, what, "x");
    MC_CHECK_ARG(!cached || !plan.expand, what, ": a cached dispatch does not expand");
    MC_CHECK_ARG(rows_alloc <= plan.metadata.size(0) && rows_alloc >= 0, what, ": ", rows_alloc,
                 " rows, more than the plan's ", plan.metadata.size(0));
    const int64_t data_bytes = H * x.element_size();
    int64_t scale_bytes = 0;
    if (scales) {
      check_dense(*scales, N, what, "scales");
      scale_bytes = scales->size(1) * scales->element_size();
    }
    if (weights) check_dense(*weights, N, what, "topk_weights");
    ht::DispatchArgs a;
    a.r = plan.routing();
    a.slots = ht::HtSlots::dispatch(buf_.layout(), static_cast<int32_t>(K), weights.has_value(),
                                    plan.expand, data_bytes, scale_bytes);
    a.cached = cached;
    a.trimmed = trimmed;
    a.x = static_cast<const uint8_t*>(x.data_ptr());
    a.x_stride = x.stride(0) * x.element_size();
    a.scales = scales ? static_cast<const uint8_t*>(scales->data_ptr()) : nullptr;
    a.weights = weights ? weights->data_ptr<float>() : nullptr;
    const int64_t rows = plan.expand ? exp_alloc : rows_alloc;
    at::Tensor recv_x = at::empty({rows, H}, x.options());
    at::Tensor recv_scales = scales ? at::empty({rows, scales->size(1)}, scales->options())
                                    : at::empty({0}, x.options());
    at::Tensor recv_idx = at::empty({rows_alloc, K}, plan.topk.options());
    const auto f32 = x.options().dtype(at::kFloat);
    at::Tensor recv_w = !weights      ? at::empty({0}, f32)
                        : plan.expand ? at::empty({exp_alloc}, f32)
                                      : at::empty({rows_alloc, K}, f32);
    a.recv_x = static_cast<uint8_t*>(recv_x.data_ptr());
    a.recv_scales = scales ? static_cast<uint8_t*>(recv_scales.data_ptr()) : nullptr;
    a.recv_idx = recv_idx.data_ptr();
    a.recv_w = weights ? recv_w.data_ptr<float>() : nullptr;
    a.metadata = plan.metadata.data_ptr<int32_t>();
    a.dst_slot = plan.dst_slot.data_ptr<int32_t>();
    a.rows_alloc = rows_alloc;
    a.exp_alloc = exp_alloc;
    a.psum_rank = plan.psum_rank.data_ptr<int32_t>();
    a.psum_expert = plan.psum_expert.data_ptr<int32_t>();
    a.unaligned = plan.unaligned.data_ptr<int32_t>();
    buf_.dispatch(a, static_cast<uint64_t>(seq), timeout_ns, active.data_ptr<int32_t>(),
                  static_cast<int>(blocks), stream());
    return {recv_x, recv_scales, recv_idx, recv_w};
  }

  // A combine along `plan`: [combined_x, combined_topk_weights (empty without)].
  std::vector<at::Tensor> combine(HtPlanTensors& plan, const at::Tensor& x,
                                  const std::optional<at::Tensor>& weights,
                                  const at::Tensor& active, bool single, int64_t seq,
                                  int64_t timeout_ns, int64_t blocks) {
    const char* what = "combine";
    check_stamps(blocks, what);
    check_active(active, what);
    const int64_t N = plan.topk.size(0), K = plan.topk.size(1), H = x.size(1);
    check_dense(x, x.size(0), what, "x");
    if (weights) check_dense(*weights, x.size(0), what, "topk_weights");
    ht::CombineArgs a;
    a.r = plan.routing();
    a.slots = ht::HtSlots::combine(buf_.layout(), static_cast<int32_t>(K), weights.has_value(),
                                   H * x.element_size());
    a.expand = plan.expand;
    a.single = single;
    if (x.scalar_type() == at::kBFloat16)
      a.elem = ht::Elem::kBf16;
    else if (x.scalar_type() == at::kHalf)
      a.elem = ht::Elem::kFp16;
    else if (x.scalar_type() == at::kFloat)
      a.elem = ht::Elem::kFp32;
    else
      throw_error(ErrorKind::kInvalidArgument, -1, what,
                  ": x must be bfloat16, float16 or float32, got ", c10::toString(x.scalar_type()));
    a.x = static_cast<const uint8_t*>(x.data_ptr());
    a.weights = weights ? weights->data_ptr<float>() : nullptr;
    a.metadata = plan.metadata.data_ptr<int32_t>();
    a.rows = x.size(0);
    at::Tensor out = at::empty({N, H}, x.options());
    at::Tensor out_w = at::empty({weights ? N : 0, K}, x.options().dtype(at::kFloat));
    a.out = static_cast<uint8_t*>(out.data_ptr());
    a.out_w = weights ? out_w.data_ptr<float>() : nullptr;
    buf_.combine(a, static_cast<uint64_t>(seq), timeout_ns, active.data_ptr<int32_t>(),
                 static_cast<int>(blocks), stream());
    return {out, out_w};
  }

  // The first n words of `plan` once the current stream has run to here
  // (EpHtBuffer::plan_head; the GIL released by the binding).
  std::vector<int32_t> plan_head(const HtPlanTensors& plan, int64_t n) {
    MC_CHECK_ARG(n <= plan.num_words, "plan_head: ", n, " words of a plan of ", plan.num_words);
    return buf_.plan_head(plan.words, n, stream());
  }

  // Profiling (bench/profile_elastic_buffer.py): later launches write each
  // block's start and end (%globaltimer ns) into `stamps`, an int64 tensor on
  // the device of at least 2 * blocks (a layout pass: 2 * blocks + 1, its last
  // block's end after them; api.h: HtCommon::stamps) (None: off).
  void set_stamps(const std::optional<at::Tensor>& stamps) {
    if (stamps) {
      MC_CHECK_ARG(
          on_device(*stamps) && stamps->scalar_type() == at::kLong && stamps->is_contiguous(),
          "set_stamps: stamps must be a contiguous int64 tensor on cuda:", buf_.device());
      stamps_ = *stamps;
    } else {
      stamps_.reset();
    }
    buf_.set_stamps(stamps_ ? reinterpret_cast<uint64_t*>(stamps_->data_ptr<int64_t>()) : nullptr);
  }

 private:
  // (The layout pass writes one stamp more: `extra`.)
  void check_stamps(int64_t blocks, const char* what, int64_t extra = 0) const {
    MC_CHECK_ARG(!stamps_ || stamps_->numel() >= 2 * blocks + extra, what, ": ", blocks,
                 " blocks need ", 2 * blocks + extra, " stamps, the tensor set has ",
                 stamps_ ? stamps_->numel() : 0);
  }

  cudaStream_t stream() const {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(buf_.device())).stream();
  }

  bool on_device(const at::Tensor& t) const {
    return t.is_cuda() && t.get_device() == buf_.device();
  }

  void check_active(const at::Tensor& t, const char* what) const {
    MC_CHECK_ARG(on_device(t) && t.scalar_type() == at::kInt && t.is_contiguous() &&
                     t.numel() == buf_.ranks(),
                 what, ": the rank mask must be a contiguous int32 tensor of ", buf_.ranks(),
                 " ranks on cuda:", buf_.device());
  }

  void check_index(const at::Tensor& t, const char* what) const {
    MC_CHECK_ARG(on_device(t) && t.dim() == 2 && t.is_contiguous() &&
                     (t.scalar_type() == at::kLong || t.scalar_type() == at::kInt),
                 what, ": topk_idx must be a contiguous int64 or int32 [N, K] tensor on cuda:",
                 buf_.device());
  }

  // Rows the kernels copy in 16-byte pieces: dense within a row, 16-byte aligned.
  void check_rows(const at::Tensor& t, int64_t n, const char* what, const char* name) const {
    const int64_t row = t.size(1) * t.element_size();
    MC_CHECK_ARG(on_device(t) && t.dim() == 2 && t.size(0) == n && (t.stride(1) == 1 || n == 0) &&
                     row % 16 == 0 && (t.stride(0) * t.element_size()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                 what, ": ", name, " must be ", n, " rows on cuda:", buf_.device(),
                 ", each dense, 16-byte aligned and a multiple of "
                 "16 bytes");
  }

  void check_dense(const at::Tensor& t, int64_t n, const char* what, const char* name) const {
    MC_CHECK_ARG(on_device(t) && t.size(0) == n && t.is_contiguous() &&
                     reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                 what, ": ", name, " must be a contiguous, 16-byte aligned tensor of ", n,
                 " rows on cuda:", buf_.device());
  }

  EpHtBuffer buf_;
  std::optional<at::Tensor> stamps_;
};

}  // namespace

void register_ep_ht_device(py::module_& m) {
  // The GIL is released where a call may wait for the device (mapping peers).
  using R = py::call_guard<py::gil_scoped_release>;
  py::class_<HtPlanTensors, std::shared_ptr<HtPlanTensors>>(
      m, "HtPlan", "A fresh ElasticBuffer dispatch's routing on the device (its handle keeps it).")
      .def_readonly("topk", &HtPlanTensors::topk)
      .def_readonly("metadata", &HtPlanTensors::metadata)
      .def_readonly("dst_slot", &HtPlanTensors::dst_slot)
      .def_readonly("psum_rank", &HtPlanTensors::psum_rank)
      .def_readonly("psum_expert", &HtPlanTensors::psum_expert)
      .def_readonly("unaligned", &HtPlanTensors::unaligned)
      .def_readonly("expand", &HtPlanTensors::expand);
  py::class_<EpHtDevice, std::shared_ptr<EpHtDevice>>(
      m, "EpHtDevice",
      "The ElasticBuffer's device path (src/device/ep_ht.h): its workspace, its peers' "
      "mappings and the kernels' launches (mooncake/ep/throughput_device.py drives it).")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("ranks"),
           py::arg("rank"), py::arg("channels"), py::arg("ring_bytes"), py::arg("device"))
      .def("card", [](EpHtDevice& d) { return py::bytes(d.buf().card()); })
      .def(
          "shares_gpu",
          [](EpHtDevice& d, const std::string& card) { return d.buf().shares_gpu(card); },
          py::arg("card"))
      .def_property_readonly("bytes",
                             [](EpHtDevice& d) { return static_cast<int64_t>(d.buf().bytes()); })
      .def_property_readonly("sm_count", [](EpHtDevice& d) { return d.buf().sm_count(); })
      .def_property_readonly("channels", [](EpHtDevice& d) { return d.buf().channels(); })
      .def(
          "connect",
          [](EpHtDevice& d, const std::vector<std::string>& cards) {
            // A C++ tuple: pybind converts it after the guard, with the GIL held again.
            auto c = d.buf().connect(cards);
            return std::make_tuple(c.reachable, c.present, c.sharers);
          },
          py::arg("cards"), R())
      .def("lost_listener",
           [](EpHtDevice& d) { return LossListenerBox{set_lost(d.buf().lost_words())}; })
      .def("take_masked", [](EpHtDevice& d) { return d.buf().take_masked(); })
      .def(
          "status", [](EpHtDevice& d, bool clear) { return d.buf().status(clear); },
          py::arg("clear") = false)
      .def("status_code", [](EpHtDevice& d) { return d.buf().status_code(); })
      .def(
          "raise_reported",
          [](EpHtDevice& d, const std::string& what) { d.buf().raise_reported(what.c_str()); },
          py::arg("what"))
      .def("dispatch_slots", &EpHtDevice::dispatch_slots, py::arg("topk"), py::arg("weights"),
           py::arg("expand"), py::arg("data_bytes"), py::arg("scale_bytes"))
      .def("combine_slots", &EpHtDevice::combine_slots, py::arg("topk"), py::arg("weights"),
           py::arg("data_bytes"))
      .def("layout", &EpHtDevice::layout, py::arg("topk_idx"), py::arg("active"),
           py::arg("max_tokens"), py::arg("num_experts"), py::arg("alignment"), py::arg("expand"),
           py::arg("signature"), py::arg("seq"), py::arg("timeout_ns"), py::arg("blocks"))
      .def("dispatch", &EpHtDevice::dispatch, py::arg("plan"), py::arg("x"), py::arg("scales"),
           py::arg("weights"), py::arg("active"), py::arg("rows_alloc"), py::arg("exp_alloc"),
           py::arg("cached"), py::arg("trimmed"), py::arg("seq"), py::arg("timeout_ns"),
           py::arg("blocks"))
      .def("combine", &EpHtDevice::combine, py::arg("plan"), py::arg("x"), py::arg("weights"),
           py::arg("active"), py::arg("single"), py::arg("seq"), py::arg("timeout_ns"),
           py::arg("blocks"))
      .def("plan_head", &EpHtDevice::plan_head, py::arg("plan"), py::arg("n"), R())
      .def("set_stamps", &EpHtDevice::set_stamps, py::arg("stamps"))
      .def("one_copy", [](EpHtDevice& d) { return d.buf().one_copy(); })
      .def(
          "one_copy_counts", [](EpHtDevice& d) { return d.buf().one_copy_counts(); }, R())
      .def("one_copy_mapped", [](EpHtDevice& d) { return d.buf().one_copy_mapped(); });
  m.def(
      "ep_ht_trim",
      [](std::vector<at::Tensor> tensors, const std::vector<int64_t>& rows) {
        // A synced dispatch's outputs cut to their valid rows, in one call (a
        // slice from Python is a torch op each). A row count below 0 leaves its
        // tensor as it is.
        MC_CHECK_ARG(tensors.size() == rows.size(), "ep_ht_trim: ", tensors.size(), " tensors and ",
                     rows.size(), " row counts");
        for (size_t i = 0; i < tensors.size(); ++i)
          if (rows[i] >= 0 && tensors[i].dim() >= 1)
            tensors[i] = tensors[i].narrow(0, 0, std::min(rows[i], tensors[i].size(0)));
        return tensors;
      },
      py::arg("tensors"), py::arg("rows"));
  m.def(
      "ep_ht_gpu",
      [](int64_t device) {
        // (PCI bus id, multiprocessors): processes with the same id share the GPU.
        return py::make_tuple(device_bus_id(static_cast<int>(device)),
                              device_sm_count(static_cast<int>(device)));
      },
      py::arg("device"));
  m.attr("EP_HT_MIN_SLOTS") = ht::kMinSlots;
  m.attr("EP_HT_MAX_RANKS") = ht::kMaxRanks;
  m.attr("EP_HT_MAX_EXPERTS") = ht::kMaxExperts;
  m.attr("EP_HT_MAX_LOCAL_EXPERTS") = ht::kMaxLocalExperts;
  m.attr("EP_HT_MAX_CHANNELS") = ht::kMaxChannels;
  m.attr("EP_HT_THREADS") = ht::kThreads;
}

}  // namespace mooncake

#else  // a CPU build: no device path (Python sees no EpHtDevice and runs the portable one)

namespace mooncake {
void register_ep_ht_device(pybind11::module_& m) {}
}  // namespace mooncake

#endif
