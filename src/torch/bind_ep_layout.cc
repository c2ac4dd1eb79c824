// Binds the EP workspace layout (src/ep/layout.h), so that Python's size
// hint and checks come from the same struct the kernels use.
#include <torch/csrc/utils/pybind.h>

#include "ep/layout.h"
#include "torch/bindings.h"

namespace py = pybind11;

namespace mooncake {

void register_ep_layout(py::module_& m) {
  m.def(
      "ep_layout",
      [](int64_t max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
        const EpLayout l(EpShape{max_tokens, hidden, num_ranks, num_experts});
        auto region = [](const EpLayout::Region& r) { return py::make_tuple(r.offset, r.bytes); };
        py::list halves;
        for (const auto& h : l.halves) {
          py::dict d;
          d["signals"] = region(h.signals);
          d["headers"] = region(h.headers);
          d["rows"] = region(h.rows);
          d["stage"] = region(h.stage);
          d["index"] = region(h.index);
          halves.append(d);
        }
        py::dict d;
        d["total_bytes"] = l.total_bytes;
        d["half_bytes"] = l.half_bytes;
        d["local_experts"] = l.local_experts;
        d["row_bytes"] = l.row_bytes;
        d["bf16_payload_bytes"] = l.bf16_payload_bytes;
        d["fp8_payload_bytes"] = l.fp8_payload_bytes;
        d["header_bytes"] = EpLayout::kHeaderBytes;
        d["max_topk"] = EpLayout::kMaxTopk;
        d["halves"] = halves;
        return d;
      },
      py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_ranks"),
      py::arg("num_experts"),
      "The EP workspace layout (src/ep/layout.h); total_bytes is the size hint.");
  m.attr("EP_HEADER_BYTES") = EpLayout::kHeaderBytes;
  m.attr("EP_MAX_TOPK") = EpLayout::kMaxTopk;
}

}  // namespace mooncake
