// The Python module: binds the backend, its options and the transfer engine,
// and maps the library's errors to Python exceptions (ValueError for bad
// arguments, TimeoutError for deadlines, mooncake.errors.PeerFailedError for a
// failed peer, mooncake.errors.LeftOutError for this rank left out of the
// group, RuntimeError otherwise).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "core/env.h"
#include "core/error.h"
#include "ep/elastic.h"
#include "ep/layout.h"
#include "torch/backend.h"
#include "torch/c10d_store.h"
#include "torch/ep_device.h"

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
  // There is no CUDA backend yet (it is to be a class of its own, and pg.py
  // does not register "mooncake"); a CUDA build's CUDA serves the EP device path.
  MC_CHECK_ARG(!cuda,
               "backend 'mooncake' (CUDA tensors) is not available yet; use 'mooncake-cpu' for "
               "CPU tensors");
  return c10::make_intrusive<MooncakeBackend>(store, rank, size, timeout, options.value_or(nullptr),
                                              std::move(engine));
}

// The elastic EP buffer's peers, with the store adapter they talk through.
struct ElasticHandle {
  std::unique_ptr<Store> store;
  std::unique_ptr<ElasticPeers> peers;
};

// Base pointers of `t`'s per-slot slices: `splits[p]` bytes each, in slot
// order, for the slots below splits.size(); null past it.
std::vector<uint8_t*> slices(const at::Tensor& t, const std::vector<int64_t>& splits, int capacity,
                             std::vector<size_t>& bytes, const char* name) {
  MC_CHECK_ARG(t.device().is_cpu() && t.is_contiguous(), "exchange: ", name,
               " must be a contiguous CPU tensor");
  MC_CHECK_ARG(static_cast<int>(splits.size()) <= capacity, "exchange: ", name, " has ",
               splits.size(), " splits, more than the capacity ", capacity);
  std::vector<uint8_t*> out(static_cast<size_t>(capacity), nullptr);
  bytes.assign(static_cast<size_t>(capacity), 0);
  uint8_t* base = static_cast<uint8_t*>(t.data_ptr());
  size_t at = 0;
  for (size_t p = 0; p < splits.size(); ++p) {
    MC_CHECK_ARG(splits[p] >= 0, "exchange: ", name, " split ", p, " is negative");
    out[p] = base + at;
    bytes[p] = static_cast<size_t>(splits[p]);
    at += bytes[p];
  }
  MC_CHECK_ARG(at <= t.nbytes(), "exchange: ", name, "'s splits add up to ", at,
               " bytes, but it has ", t.nbytes());
  return out;
}

void register_ep_elastic(py::module_& m) {
  py::class_<ElasticHandle>(m, "ElasticPeers",
                            "The elastic EP buffer's peers (src/ep/elastic.h): slots, masks, "
                            "staged connections and exchanges among the active slots.")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store,
                       const std::shared_ptr<TransferEngine>& engine, int rank, int capacity,
                       int local_experts, int64_t timeout_ms, int64_t metadata_timeout_ms,
                       const std::string& prefix) {
             MC_CHECK_ARG(engine != nullptr, "ElasticPeers: engine is None");
             ElasticConfig c;
             c.rank = rank;
             c.capacity = capacity;
             c.local_experts = local_experts;
             c.timeout_ms = timeout_ms;
             c.metadata_timeout_ms = metadata_timeout_ms;
             c.prefix = prefix;
             auto h = std::make_unique<ElasticHandle>();
             h->store = std::make_unique<C10dStore>(store);
             h->peers = std::make_unique<ElasticPeers>(*engine, *h->store, c);
             return h;
           }),
           py::arg("store"), py::arg("engine"), py::arg("rank"), py::arg("capacity"),
           py::arg("local_experts"), py::arg("timeout_ms"), py::arg("metadata_timeout_ms"),
           py::arg("prefix"), py::call_guard<py::gil_scoped_release>())
      .def(
          "connect",
          [](ElasticHandle& h, const std::vector<int>& peers, bool activate) {
            h.peers->connect(peers, activate);
          },
          py::arg("peers"), py::arg("activate"), py::call_guard<py::gil_scoped_release>())
      .def(
          "set_masked",
          [](ElasticHandle& h, int peer, bool masked) { h.peers->set_masked(peer, masked); },
          py::arg("peer"), py::arg("masked"), py::call_guard<py::gil_scoped_release>())
      .def(
          "disconnect",
          [](ElasticHandle& h, const std::vector<int>& peers) { h.peers->disconnect(peers); },
          py::arg("peers"), py::call_guard<py::gil_scoped_release>())
      .def(
          "exchange",
          [](ElasticHandle& h, at::Tensor out, at::Tensor inp,
             const std::vector<int64_t>& out_bytes, const std::vector<int64_t>& in_bytes, int bound,
             int64_t timeout_ms) {
            const int cap = h.peers->config().capacity;
            MC_CHECK_ARG(
                out_bytes.size() == in_bytes.size() && static_cast<int>(in_bytes.size()) == bound,
                "exchange: one split per slot below bound (", bound, ") on each side");
            std::vector<size_t> send_n, recv_n;
            std::vector<uint8_t*> send = slices(inp, in_bytes, cap, send_n, "input");
            std::vector<uint8_t*> recv = slices(out, out_bytes, cap, recv_n, "output");
            std::vector<const void*> csend(send.begin(), send.end());
            std::vector<void*> vrecv(recv.begin(), recv.end());
            py::gil_scoped_release release;
            return h.peers->exchange(csend.data(), send_n.data(), vrecv.data(), recv_n.data(),
                                     bound, timeout_ms);
          },
          py::arg("out"), py::arg("inp"), py::arg("out_bytes"), py::arg("in_bytes"),
          py::arg("bound"), py::arg("timeout_ms"))
      .def(
          "barrier",
          [](ElasticHandle& h, int64_t timeout_ms) { return h.peers->barrier(timeout_ms); },
          py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
      .def("state", [](const ElasticHandle& h,
                       int slot) { return slot_state_name(h.peers->slots().state(slot)); })
      .def("generation",
           [](const ElasticHandle& h, int slot) { return h.peers->slots().generation(slot); })
      .def_property_readonly("rank_bound",
                             [](const ElasticHandle& h) { return h.peers->slots().rank_bound(); })
      .def_property_readonly("num_active",
                             [](const ElasticHandle& h) { return h.peers->slots().num_active(); })
      .def_property_readonly("active_slots",
                             [](const ElasticHandle& h) { return h.peers->slots().active_slots(); })
      .def_property_readonly("incarnation",
                             [](const ElasticHandle& h) { return h.peers->incarnation(); })
      .def("describe", [](const ElasticHandle& h) { return h.peers->slots().describe(); })
      .def("mask",
           [](const ElasticHandle& h) {
             std::vector<int32_t> out(static_cast<size_t>(h.peers->config().capacity));
             h.peers->slots().query_mask(out.data(), out.size());
             return out;
           })
      .def("transport_of", [](const ElasticHandle& h,
                              int peer) { return std::string(h.peers->transport_of(peer)); })
      .def("events", [](const ElasticHandle& h) { return h.peers->events(); });
}

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

PYBIND11_MODULE(MOONCAKE_PG_MODULE, m) {
  m.doc() = "mooncake process-group backend (compiled for torch " MOONCAKE_TORCH_TAG ")";
  py::module_::import("torch.distributed");

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
          d["dispatch"] = region(h.dispatch);
          d["combine"] = region(h.combine);
          d["stage"] = region(h.stage);
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
        d["max_topk"] = EpLayout::kMaxTopk;
        d["halves"] = halves;
        return d;
      },
      py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_ranks"),
      py::arg("num_experts"),
      "The EP workspace layout (src/ep/layout.h); total_bytes is the size hint.");
  m.attr("EP_HEADER_BYTES") = EpLayout::kHeaderBytes;
  m.attr("EP_MAX_TOPK") = EpLayout::kMaxTopk;
  register_ep_elastic(m);
  register_ep_device(m);
  m.def("env_registry", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const auto& v : env_registry()) out.emplace_back(v.name, v.default_value, v.doc);
    return out;
  });
}
