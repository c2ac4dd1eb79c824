// The Python module: the backend, its options, the transfer engine, the EP
// layout, the elastic EP peers and the EP device path, each registered by its
// own part (bindings.h).
#include <torch/csrc/utils/pybind.h>

#include "torch/bindings.h"

namespace py = pybind11;
using namespace mooncake;

#define MC_STRINGIFY2(x) #x
#define MC_STRINGIFY(x) MC_STRINGIFY2(x)

namespace {

// What this extension was compiled for and with (python -m mooncake doctor).
void register_build_info(py::module_& m) {
  m.def("build_info", [] {
    py::dict d;
    d["torch"] = MOONCAKE_TORCH_TAG;
    d["cuda"] = static_cast<bool>(MOONCAKE_WITH_CUDA);
    d["module"] = MC_STRINGIFY(MOONCAKE_PG_MODULE);
    d["compiler"] = __VERSION__;
    return d;
  });
}

}  // namespace

PYBIND11_MODULE(MOONCAKE_PG_MODULE, m) {
  m.doc() = "mooncake process-group backend (compiled for torch " MOONCAKE_TORCH_TAG ")";
  // It registers the base classes that ours derive from (c10d Backend, its Options).
  py::module_::import("torch.distributed");

  register_errors(m);
  register_engine(m);
  register_backend(m);
  register_build_info(m);
  register_ep_layout(m);
  register_ep_elastic(m);
  register_ep_device(m);
  register_ep_ht_device(m);
  register_env(m);
}
