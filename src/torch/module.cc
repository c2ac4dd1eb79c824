// The Python module: binds the backend, its options and the transfer engine,
// and maps the library's errors to Python exceptions (ValueError for bad
// arguments, TimeoutError for deadlines, RuntimeError otherwise).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "core/env.h"
#include "core/error.h"
#include "ep/layout.h"
#include "torch/backend.h"

namespace py = pybind11;
using namespace mooncake;

#define MC_STRINGIFY2(x) #x
#define MC_STRINGIFY(x) MC_STRINGIFY2(x)

namespace {

c10::intrusive_ptr<MooncakeBackend> create_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout,
    std::optional<c10::intrusive_ptr<MooncakeBackendOptions>> options,
    std::shared_ptr<TransferEngine> engine, bool cuda) {
  MC_CHECK_ARG(engine != nullptr, "create_backend: engine is None");
  MC_CHECK_ARG(!cuda || MOONCAKE_WITH_CUDA,
               "backend 'mooncake' needs CUDA, but this build of mooncake has none; use "
               "'mooncake-cpu' for CPU tensors");
  return c10::make_intrusive<MooncakeBackend>(store, rank, size, timeout, options.value_or(nullptr),
                                              std::move(engine), cuda);
}

}  // namespace

PYBIND11_MODULE(MOONCAKE_PG_MODULE, m) {
  m.doc() = "mooncake process-group backend (compiled for torch " MOONCAKE_TORCH_TAG ")";
  py::module_::import("torch.distributed");

  static py::exception<Error> base_error(m, "MooncakeError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      switch (e.kind()) {
        case ErrorKind::kInvalidArgument: PyErr_SetString(PyExc_ValueError, e.what()); return;
        case ErrorKind::kTimeout: PyErr_SetString(PyExc_TimeoutError, e.what()); return;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); return;
      }
    }
  });

  py::class_<TransferEngine, std::shared_ptr<TransferEngine>>(
      m, "TransferEngine",
      "Transport policy shared by the process groups that use it: which transports to use, "
      "which host address to publish, which RDMA devices to consider.")
      .def(py::init([] { return std::make_shared<TransferEngine>(EngineOptions::from_env()); }))
      .def_property(
          "host_ip", [](const TransferEngine& e) { return e.options().host_ip; },
          [](TransferEngine& e, const std::string& ip) { e.mutable_options().host_ip = ip; })
      .def_property(
          "force_tcp", [](const TransferEngine& e) { return e.options().force_tcp; },
          [](TransferEngine& e, bool v) { e.mutable_options().force_tcp = v; })
      .def_property(
          "device_filter", [](const TransferEngine& e) { return e.options().device_filter; },
          [](TransferEngine& e, const std::vector<std::string>& f) {
            e.mutable_options().device_filter = f;
          })
      .def_static("available_transports", &TransferEngine::available_transports);

  py::class_<MooncakeBackendOptions, c10d::Backend::Options,
             c10::intrusive_ptr<MooncakeBackendOptions>>(m, "MooncakeBackendOptions")
      .def(py::init([](at::Tensor active_ranks, bool is_extension,
                       std::optional<int64_t> max_world_size) {
             return c10::make_intrusive<MooncakeBackendOptions>(std::move(active_ranks),
                                                                is_extension, max_world_size);
           }),
           py::arg("active_ranks"), py::arg("is_extension") = false,
           py::arg("max_world_size") = py::none())
      .def_readonly("active_ranks", &MooncakeBackendOptions::active_ranks)
      .def_readonly("is_extension", &MooncakeBackendOptions::is_extension)
      .def_readonly("max_world_size", &MooncakeBackendOptions::max_world_size)
      .def("__deepcopy__", [](const MooncakeBackendOptions& o, py::dict) {
        // new_group() copies the parent's options: a subgroup gets its own
        // all-active mask sized to its own world, and joins a running group
        // when its parent still does (see pg.join_group).
        auto copy =
            c10::make_intrusive<MooncakeBackendOptions>(at::Tensor(), o.is_extension, std::nullopt);
        copy->timeout = o.timeout;
        return copy;
      });

  py::class_<MooncakeBackend, c10d::Backend, c10::intrusive_ptr<MooncakeBackend>>(m,
                                                                                  "MooncakeBackend")
      .def("active_ranks", &MooncakeBackend::active_ranks)
      .def("num_synced_ranks", &MooncakeBackend::num_synced_ranks)
      .def("extend_group_size_to", &MooncakeBackend::extend_group_size_to, py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("get_peer_state", &MooncakeBackend::get_peer_state, py::arg("ranks"),
           py::call_guard<py::gil_scoped_release>())
      .def("recover_ranks", &MooncakeBackend::recover_ranks, py::arg("ranks"),
           py::arg("wait") = false, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("joining", &MooncakeBackend::joining)
      .def("join_group", &MooncakeBackend::join_group, py::call_guard<py::gil_scoped_release>())
      .def("transport_of", &MooncakeBackend::transport_of, py::arg("peer"))
      .def_property_readonly("engine", &MooncakeBackend::engine);

  m.def("create_backend", &create_backend, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout"), py::arg("options"), py::arg("engine"), py::arg("cuda"),
        py::call_guard<py::gil_scoped_release>());

  m.def("build_info", [] {
    py::dict d;
    d["torch"] = MOONCAKE_TORCH_TAG;
    d["cuda"] = static_cast<bool>(MOONCAKE_WITH_CUDA);
    d["module"] = MC_STRINGIFY(MOONCAKE_PG_MODULE);
    d["compiler"] = __VERSION__;
    return d;
  });
  m.def(
      "ep_layout",
      [](int64_t max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
        const EpLayout l(EpShape{max_tokens, hidden, num_ranks, num_experts});
        auto region = [](const EpLayout::Region& r) { return py::make_tuple(r.offset, r.bytes); };
        py::list halves;
        for (const auto& h : l.halves) {
          py::dict d;
          d["signals"] = region(h.signals);
          d["send"] = region(h.send);
          d["recv"] = region(h.recv);
          halves.append(d);
        }
        py::dict d;
        d["total_bytes"] = l.total_bytes;
        d["half_bytes"] = l.half_bytes;
        d["local_experts"] = l.local_experts;
        d["dispatch_msg_bytes"] = l.dispatch_msg_bytes;
        d["combine_msg_bytes"] = l.combine_msg_bytes;
        d["bf16_payload_bytes"] = l.bf16_payload_bytes;
        d["fp8_payload_bytes"] = l.fp8_payload_bytes;
        d["header_bytes"] = EpLayout::kHeaderBytes;
        d["halves"] = halves;
        return d;
      },
      py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_ranks"),
      py::arg("num_experts"),
      "The EP workspace layout (src/ep/layout.h); total_bytes is the size hint.");
  m.def("env_registry", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const auto& v : env_registry()) out.emplace_back(v.name, v.default_value, v.doc);
    return out;
  });
}
