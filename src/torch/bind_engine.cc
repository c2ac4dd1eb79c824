// Binds TransferEngine, the transport policy that process groups share: the
// transports to use, the host address to publish, the RDMA devices to
// consider.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "torch/bindings.h"
#include "transport/engine.h"

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
}

}  // namespace mooncake
