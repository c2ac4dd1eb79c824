// Binds the backends: MooncakeBackendOptions (pg_options), MooncakeBackend's
// helpers beyond c10d's (the pg.* API), MooncakeCudaBackend (with CUDA), and
// create_backend, which mooncake/pg.py registers with torch.distributed.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "core/error.h"
#include "torch/backend.h"
#include "torch/bindings.h"
#if MOONCAKE_WITH_CUDA
#include "torch/cuda_backend.h"
#endif

namespace py = pybind11;

namespace mooncake {

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
#if MOONCAKE_WITH_CUDA
  if (cuda)
    return c10::make_intrusive<MooncakeCudaBackend>(store, rank, size, timeout,
                                                    options.value_or(nullptr), std::move(engine));
#endif
  return c10::make_intrusive<MooncakeBackend>(store, rank, size, timeout, options.value_or(nullptr),
                                              std::move(engine));
}

}  // namespace

void register_backend(py::module_& m) {
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
      .def("view_version", &MooncakeBackend::view_version)
      .def("extend_group_size_to", &MooncakeBackend::extend_group_size_to, py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("get_peer_state", &MooncakeBackend::get_peer_state, py::arg("ranks"),
           py::call_guard<py::gil_scoped_release>())
      .def("recover_ranks", &MooncakeBackend::recover_ranks, py::arg("ranks"),
           py::arg("wait") = false, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("joining", &MooncakeBackend::joining)
      .def("join_group", &MooncakeBackend::join_group, py::call_guard<py::gil_scoped_release>())
      .def("transport_of", &MooncakeBackend::transport_of, py::arg("peer"))
      .def("reject_next", &MooncakeBackend::reject_next, py::arg("reason"))
      .def_property_readonly("engine", &MooncakeBackend::engine);

#if MOONCAKE_WITH_CUDA
  py::class_<MooncakeCudaBackend, MooncakeBackend, c10::intrusive_ptr<MooncakeCudaBackend>>(
      m, "MooncakeCudaBackend")
      .def_property_readonly("device", &MooncakeCudaBackend::device);
#endif

  m.def("create_backend", &create_backend, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout"), py::arg("options"), py::arg("engine"), py::arg("cuda"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace mooncake
