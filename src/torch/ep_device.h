// The EP device path's binding (ep_device.cc): registers EpDevice when this
// build has CUDA, nothing otherwise.
#pragma once

#include <pybind11/pybind11.h>

namespace mooncake {

void register_ep_device(pybind11::module_& m);

}  // namespace mooncake
