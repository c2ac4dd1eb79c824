// Binds TransferEngine, the transport policy that process groups share: the
// transports to use, the host address to publish, the RDMA devices to
// consider.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "torch/bindings.h"
#include "transport/engine.h"
#include "transport/life.h"
#include "transport/loss_times.h"

namespace py = pybind11;

namespace mooncake {

void register_engine(py::module_& m) {
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
  py::class_<LossListenerBox>(m, "LossListener",
                              "Called from a transport's heartbeat thread with each peer it "
                              "sees lost (made by EpDevice.lost_listener).");
  const auto seconds = [](std::optional<int64_t> us) -> std::optional<double> {
    if (!us) return std::nullopt;
    return static_cast<double>(*us) * 1e-6;
  };
  py::class_<LossTimes, std::shared_ptr<LossTimes>>(
      m, "LossTimes",
      "When a group's transport told of each peer's loss, in time.monotonic() seconds "
      "(mooncake.pg.watch_loss_times makes one).")
      .def(py::init<int>(), py::arg("capacity"))
      .def("listener", [](LossTimes& t) { return LossListenerBox{t.listener()}; })
      .def_property_readonly("capacity", &LossTimes::capacity)
      .def(
          "gone_at", [seconds](const LossTimes& t, int peer) { return seconds(t.gone_us(peer)); },
          py::arg("peer"))
      .def(
          "silent_at",
          [seconds](const LossTimes& t, int peer) { return seconds(t.silent_us(peer)); },
          py::arg("peer"));
  m.def(
      "life_page",
      [] {
        // This process's life page as a peer maps it (python -m mooncake doctor).
        const LifeRef ref = process_life();
        if (!ref.valid())
          throw_error(ErrorKind::kSystem, -1,
                      "this kernel refused a life page (memfd or robust futex lists): GPU "
                      "kernels hear of a dead peer from this host's transport only");
        const LifeView view(ref);
        py::dict d;
        d["pid"] = ref.pid;
        d["fd"] = ref.fd;
        d["held"] = life_held(view.word().load());
        return d;
      },
      "This process's life page (made on the first call), mapped as a peer maps it: its pid, "
      "its fd, and whether a live thread holds its word.");
}

}  // namespace mooncake
