// The Python module's parts (module.cc calls them in turn): each registers
// one subsystem's classes and functions on the module.
#pragma once

#include <pybind11/pybind11.h>

#include "transport/engine.h"

namespace mooncake {

// A listener for lost peers (Endpoint::watch_peers) handed between bindings
// as a Python object: the device path makes one (EpDevice.lost_listener) and
// whoever watches the peers (a group, an elastic buffer's peers) takes it.
struct LossListenerBox {
  Endpoint::LossListener fn;
};

// Maps the library's errors to Python exceptions (bind_errors.cc).
void register_errors(pybind11::module_& m);
// TransferEngine, the transport policy (bind_engine.cc).
void register_engine(pybind11::module_& m);
// MooncakeBackendOptions, MooncakeBackend and create_backend (bind_backend.cc).
void register_backend(pybind11::module_& m);
// ep_layout and its constants (bind_ep_layout.cc).
void register_ep_layout(pybind11::module_& m);
// ElasticPeers, the elastic EP buffer's peers (bind_ep_elastic.cc).
void register_ep_elastic(pybind11::module_& m);
// EpDevice when this build has CUDA, nothing otherwise (ep_device.cc).
void register_ep_device(pybind11::module_& m);
// EpHtDevice and HtPlan when this build has CUDA, nothing otherwise (ep_ht_device.cc).
void register_ep_ht_device(pybind11::module_& m);
// env_registry (bind_env.cc).
void register_env(pybind11::module_& m);

}  // namespace mooncake
