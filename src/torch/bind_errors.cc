// Maps the library's errors to Python exceptions: ValueError for bad
// arguments, TimeoutError for deadlines, mooncake.errors.PeerFailedError for
// a failed peer, mooncake.errors.LeftOutError for this rank left out of the
// group, RuntimeError otherwise.
#include <torch/csrc/utils/pybind.h>

#include "core/error.h"
#include "torch/bindings.h"

namespace py = pybind11;

namespace mooncake {

namespace {

// Sets the Python error `cls_name` of mooncake.errors (a RuntimeError
// subclass) for `e`, with .ranks = [e.peer()] when it names one. That module
// imports nothing of ours, so importing it here cannot recurse.
void set_typed_error(const char* cls_name, const Error& e) {
  try {
    py::object cls = py::module_::import("mooncake.errors").attr(cls_name);
    py::list ranks;
    if (e.peer() >= 0) ranks.append(e.peer());
    py::object exc = cls(e.what(), ranks);
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (py::error_already_set&) {
    PyErr_SetString(PyExc_RuntimeError, e.what());  // no mooncake package on the path
  }
}

}  // namespace

void register_errors(py::module_&) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      switch (e.kind()) {
        case ErrorKind::kInvalidArgument: PyErr_SetString(PyExc_ValueError, e.what()); return;
        case ErrorKind::kTimeout: PyErr_SetString(PyExc_TimeoutError, e.what()); return;
        case ErrorKind::kPeerFailed: set_typed_error("PeerFailedError", e); return;
        case ErrorKind::kLeftOut: set_typed_error("LeftOutError", e); return;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); return;
      }
    }
  });
}

}  // namespace mooncake
