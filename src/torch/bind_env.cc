// Binds env_registry: every MOONCAKE_* variable with its default and doc
// (core/env.h), so that Python reads the defaults and `python -m mooncake
// doctor` lists them from the one registry.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "core/env.h"
#include "torch/bindings.h"

namespace py = pybind11;

namespace mooncake {

void register_env(py::module_& m) {
  m.def("env_registry", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const auto& v : env_registry()) out.emplace_back(v.name, v.default_value, v.doc);
    return out;
  });
}

}  // namespace mooncake
