// Binds the backends: MooncakeBackendOptions (pg_options, with upstream's
// constructors), MooncakeBackend's helpers beyond c10d's (the pg.* API), the
// responses of membership changes, the Work queries, MooncakeCudaBackend
// (with CUDA), and create_backend, which mooncake/pg.py registers with
// torch.distributed.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "core/error.h"
#include "torch/backend.h"
#include "torch/bindings.h"
#include "torch/work.h"
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

// A group size given as a Python int: a py::int_ parameter, so that neither a
// bool nor a one-element tensor (which has __index__) is taken for one.
int64_t group_size_arg(const py::int_& v, const char* name) {
  MC_CHECK_ARG(!PyBool_Check(v.ptr()), "MooncakeBackendOptions: ", name,
               " must be an int, got a bool");
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  // The message names max_world_size too: our earlier name of max_group_size.
  MC_CHECK_ARG(overflow == 0 && n >= 1 && n <= INT_MAX, "MooncakeBackendOptions: ", name,
               std::string(name) == "max_group_size" ? " (max_world_size)" : "",
               " must be >= 1 and fit an int, got ", py::repr(v).cast<std::string>());
  return n;
}

c10::intrusive_ptr<MooncakeBackendOptions> make_options(
    at::Tensor active_ranks, bool is_extension, const std::optional<py::int_>& max_group_size,
    const std::optional<py::int_>& max_world_size, bool auto_deactivate,
    std::optional<bool> auto_sync) {
  MC_CHECK_ARG(!(max_group_size && max_world_size),
               "MooncakeBackendOptions: give max_group_size or max_world_size (its other name), "
               "not both");
  std::optional<int64_t> slots;
  if (max_group_size) slots = group_size_arg(*max_group_size, "max_group_size");
  if (max_world_size) slots = group_size_arg(*max_world_size, "max_world_size");
  // Unset: as auto_deactivate_on_failure (upstream's constructors without it
  // mean both on).
  return c10::make_intrusive<MooncakeBackendOptions>(std::move(active_ranks), is_extension, slots,
                                                     auto_deactivate,
                                                     auto_sync.value_or(auto_deactivate));
}

std::string repr(const ProposalResponse& r) {
  static const char* names[] = {"Rejected", "Applied", "AppliedWithDroppedRanks"};
  std::string dropped;
  for (int64_t q : r.dropped_ranks) dropped += (dropped.empty() ? "" : ", ") + std::to_string(q);
  return str("ProposeViewUpdateResponse(status=ProposalStatus.", names[static_cast<int>(r.status)],
             ", new_epoch=", r.new_epoch, ", dropped_ranks=[", dropped,
             "], reject_reason=", py::repr(py::str(r.reject_reason)).cast<std::string>(), ")");
}

void register_responses(py::module_& m) {
  py::enum_<ProposalStatus> proposal(m, "ProposalStatus");
  proposal.value("Rejected", ProposalStatus::kRejected)
      .value("Applied", ProposalStatus::kApplied)
      .value("AppliedWithDroppedRanks", ProposalStatus::kAppliedWithDroppedRanks);
  m.attr("ViewUpdateStatus") = proposal;  // upstream's earlier name of the same enum
  py::enum_<SyncStatus>(m, "SyncAfterFailureStatus")
      .value("Reconciled", SyncStatus::kReconciled)
      .value("NoPending", SyncStatus::kNoPending)
      .value("Rejected", SyncStatus::kRejected);
  py::class_<ProposalResponse>(m, "ProposeViewUpdateResponse")
      .def_property_readonly("status", [](const ProposalResponse& r) { return r.status; })
      .def_property_readonly("new_epoch", [](const ProposalResponse& r) { return r.new_epoch; })
      .def_property_readonly("dropped_ranks",
                             [](const ProposalResponse& r) { return r.dropped_ranks; })
      .def_property_readonly("reject_reason",
                             [](const ProposalResponse& r) { return r.reject_reason; })
      .def("__repr__", &repr);
  py::class_<SyncResponse>(m, "SyncAfterFailureResponse")
      .def_property_readonly("status", [](const SyncResponse& r) { return r.status; })
      .def_property_readonly("reject_reason", [](const SyncResponse& r) { return r.reject_reason; })
      .def("__repr__", [](const SyncResponse& r) {
        static const char* names[] = {"Reconciled", "NoPending", "Rejected"};
        return str("SyncAfterFailureResponse(status=SyncAfterFailureStatus.",
                   names[static_cast<int>(r.status)],
                   ", reject_reason=", py::repr(py::str(r.reject_reason)).cast<std::string>(), ")");
      });
}

void register_options(py::module_& m) {
  using Options = MooncakeBackendOptions;
  // Upstream's six constructors: (active_ranks[, is_extension[, max_group_size]])
  // and (max_group_size[, is_extension[, auto_deactivate_on_failure,
  // auto_sync_on_failure]]). The tensor forms come first, and a group size
  // is a py::int_, so a one-element tensor never reaches the int forms.
  py::class_<Options, c10d::Backend::Options, c10::intrusive_ptr<Options>>(m,
                                                                           "MooncakeBackendOptions")
      .def(py::init([](at::Tensor active_ranks, bool is_extension,
                       std::optional<py::int_> max_group_size,
                       std::optional<py::int_> max_world_size, bool auto_deactivate,
                       std::optional<bool> auto_sync) {
             return make_options(std::move(active_ranks), is_extension, max_group_size,
                                 max_world_size, auto_deactivate, auto_sync);
           }),
           py::arg("active_ranks"), py::arg("is_extension") = false,
           py::arg("max_group_size") = py::none(), py::kw_only(),
           py::arg("max_world_size") = py::none(), py::arg("auto_deactivate_on_failure") = true,
           py::arg("auto_sync_on_failure") = py::none())
      .def(py::init([](py::int_ max_group_size, bool is_extension, bool auto_deactivate,
                       std::optional<bool> auto_sync) {
             return make_options(at::Tensor(), is_extension, max_group_size, std::nullopt,
                                 auto_deactivate, auto_sync);
           }),
           py::arg("max_group_size"), py::arg("is_extension") = false,
           py::arg("auto_deactivate_on_failure") = true,
           py::arg("auto_sync_on_failure") = py::none())
      .def_readonly("active_ranks", &Options::active_ranks)
      .def_readonly("is_extension", &Options::is_extension)
      .def_readonly("max_group_size", &Options::max_world_size)
      .def_readonly("max_world_size", &Options::max_world_size)
      .def_readonly("auto_deactivate_on_failure", &Options::auto_deactivate_on_failure)
      .def_readonly("auto_sync_on_failure", &Options::auto_sync_on_failure)
      .def("__deepcopy__", [](const Options& o, py::dict) {
        // new_group() copies the parent's options: a subgroup gets its own
        // all-active mask sized to its own world, and joins a running group
        // when its parent still does (see pg.join_group); its failure
        // handling is the parent's.
        auto copy = o.with_mask(at::Tensor());
        copy->max_world_size = std::nullopt;
        return copy;
      });
}

}  // namespace

void register_backend(py::module_& m) {
  register_responses(m);
  register_options(m);

  py::class_<MooncakeBackend, c10d::Backend, c10::intrusive_ptr<MooncakeBackend>>(m,
                                                                                  "MooncakeBackend")
      .def("active_ranks", &MooncakeBackend::active_ranks)
      .def("num_synced_ranks", &MooncakeBackend::num_synced_ranks)
      .def("view_version", &MooncakeBackend::view_version)
      .def("view_version_address",
           [](const MooncakeBackend& b) {
             static_assert(std::atomic<int64_t>::is_always_lock_free &&
                           sizeof(std::atomic<int64_t>) == sizeof(int64_t));
             return reinterpret_cast<uintptr_t>(b.view_version_word());
           })
      .def("extend_group_size_to", &MooncakeBackend::extend_group_size_to, py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("get_peer_state", &MooncakeBackend::get_peer_state, py::arg("ranks"),
           py::call_guard<py::gil_scoped_release>())
      .def("recover_ranks", &MooncakeBackend::recover_ranks, py::arg("ranks"),
           py::arg("wait") = false, py::call_guard<py::gil_scoped_release>())
      .def("deactivate_ranks", &MooncakeBackend::deactivate_ranks, py::arg("ranks"),
           py::call_guard<py::gil_scoped_release>())
      .def("sync_after_failure", &MooncakeBackend::sync_after_failure,
           py::call_guard<py::gil_scoped_release>())
      .def("current_epoch", &MooncakeBackend::current_epoch)
      .def("left_out", &MooncakeBackend::left_out)
      .def_property_readonly("options", &MooncakeBackend::options)
      .def("_timeouts_ms", &MooncakeBackend::timeouts_ms)
      .def_property_readonly("joining", &MooncakeBackend::joining)
      .def("join_group", &MooncakeBackend::join_group, py::call_guard<py::gil_scoped_release>())
      .def("transport_of", &MooncakeBackend::transport_of, py::arg("peer"))
      .def("reject_next", &MooncakeBackend::reject_next, py::arg("reason"))
      .def(
          "watch_peers", [](MooncakeBackend& b, const LossListenerBox& l) { b.watch_peers(l.fn); },
          py::arg("listener"))
      .def_property_readonly("engine", &MooncakeBackend::engine);

#if MOONCAKE_WITH_CUDA
  m.def("relax_library_threads", &relax_library_threads,
        "Library threads started from now on run in relaxed CUDA graph capture mode "
        "(device/cuda.h); mooncake/pg.py calls it before a CUDA group's engine starts.");
  py::class_<MooncakeCudaBackend, MooncakeBackend, c10::intrusive_ptr<MooncakeCudaBackend>>(
      m, "MooncakeCudaBackend")
      .def_property_readonly("device", &MooncakeCudaBackend::device)
      .def("op_paths", [](const MooncakeCudaBackend& b) {
        const auto [device, staged] = b.op_paths();
        py::dict d;
        d["device"] = device;
        d["staged"] = staged;
        d["direct"] = b.direct_ops();
        const auto [mapped, mapped_planed] = b.mapped_pieces();
        d["mapped"] = mapped;
        d["mapped_planed"] = mapped_planed;
        d["p2p_device"] = b.p2p_device_ops();
        d["p2p_lent"] = b.p2p_lent();
        return d;
      });
#endif

  m.def("create_backend", &create_backend, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout"), py::arg("options"), py::arg("engine"), py::arg("cuda"),
        py::call_guard<py::gil_scoped_release>());

  // Works of every backend come in; another backend's get upstream's answers.
  m.def(
      "get_failed_ranks_hint", [](c10d::Work& work) { return failed_ranks_hint(work); },
      py::arg("work"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "get_local_success", [](c10d::Work& work) { return local_success(work); }, py::arg("work"),
      py::call_guard<py::gil_scoped_release>());
  // pg.set_*_us (checked there), for groups created afterwards; < 0: unset.
  m.def(
      "set_group_default",
      [](const std::string& knob, int64_t ms) {
        GroupDefaults& d = group_defaults();
        std::atomic<int64_t>* field = knob == "collective_timeout_ms" ? &d.collective_timeout_ms
                                      : knob == "p2p_timeout_ms"      ? &d.p2p_timeout_ms
                                      : knob == "report_grace_ms"     ? &d.report_grace_ms
                                                                      : nullptr;
        MC_CHECK_ARG(field != nullptr, "set_group_default: unknown knob '", knob, "'");
        field->store(ms);
      },
      py::arg("knob"), py::arg("ms"));
}

}  // namespace mooncake
