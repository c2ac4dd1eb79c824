// Binds ElasticPeers (src/ep/elastic.h), the elastic EP buffer's peers, with
// the c10d store adapter they talk through; mooncake/ep/elastic.py drives them.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "core/error.h"
#include "ep/elastic.h"
#include "torch/bindings.h"
#include "torch/c10d_store.h"

namespace py = pybind11;

namespace mooncake {

namespace {

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

}  // namespace

void register_ep_elastic(py::module_& m) {
  py::class_<ElasticHandle>(m, "ElasticPeers",
                            "The elastic EP buffer's peers (src/ep/elastic.h): slots, masks, "
                            "staged connections and exchanges among the active slots.")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store,
                       const std::shared_ptr<TransferEngine>& engine, int rank, int capacity,
                       int local_experts, int64_t timeout_ms, int64_t metadata_timeout_ms,
                       const std::string& prefix, const std::string& device_meta) {
             MC_CHECK_ARG(engine != nullptr, "ElasticPeers: engine is None");
             ElasticConfig c;
             c.rank = rank;
             c.capacity = capacity;
             c.local_experts = local_experts;
             c.timeout_ms = timeout_ms;
             c.metadata_timeout_ms = metadata_timeout_ms;
             c.prefix = prefix;
             c.device_meta = device_meta;
             auto h = std::make_unique<ElasticHandle>();
             h->store = std::make_unique<C10dStore>(store);
             h->peers = std::make_unique<ElasticPeers>(*engine, *h->store, c);
             return h;
           }),
           py::arg("store"), py::arg("engine"), py::arg("rank"), py::arg("capacity"),
           py::arg("local_experts"), py::arg("timeout_ms"), py::arg("metadata_timeout_ms"),
           py::arg("prefix"), py::arg("device_meta") = "", py::call_guard<py::gil_scoped_release>())
      .def(
          "connect",
          [](ElasticHandle& h, const std::vector<int>& peers, bool activate, uint64_t calls) {
            h.peers->connect(peers, activate, calls);
          },
          py::arg("peers"), py::arg("activate"), py::arg("calls") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "set_masked",
          [](ElasticHandle& h, int peer, bool masked, uint64_t calls) {
            h.peers->set_masked(peer, masked, calls);
          },
          py::arg("peer"), py::arg("masked"), py::arg("calls") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "await_call_count",
          [](ElasticHandle& h, int64_t timeout_ms) {
            return h.peers->await_call_count(timeout_ms);
          },
          py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
      .def(
          "set_device_meta",
          [](ElasticHandle& h, const std::string& meta) { h.peers->set_device_meta(meta); },
          py::arg("meta"), py::call_guard<py::gil_scoped_release>())
      .def("count_pending", [](const ElasticHandle& h) { return h.peers->count_pending(); })
      .def("device_meta",
           [](const ElasticHandle& h, int peer) { return h.peers->device_meta(peer); })
      .def(
          "note_masked",
          [](ElasticHandle& h, int peer, const std::string& why) {
            h.peers->note_masked(peer, why);
          },
          py::arg("peer"), py::arg("why"))
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
      .def(
          "reject",
          [](ElasticHandle& h, const std::string& reason, int64_t timeout_ms) {
            h.peers->reject(reason, timeout_ms);
          },
          py::arg("reason"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
      .def("rejections", [](const ElasticHandle& h) { return h.peers->rejections(); })
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
      .def("incarnation_of",
           [](const ElasticHandle& h, int peer) { return h.peers->incarnation_of(peer); })
      .def("left_out", [](const ElasticHandle& h) { return h.peers->left_out(); })
      .def(
          "check_member",
          [](const ElasticHandle& h, const std::string& what) {
            h.peers->check_member(what.c_str());
          },
          py::arg("what"))
      .def("peer_left_out",
           [](const ElasticHandle& h, int peer) { return h.peers->peer_left_out(peer); })
      .def("take_left_out", [](ElasticHandle& h) { return h.peers->take_left_out(); })
      .def("describe", [](const ElasticHandle& h) { return h.peers->slots().describe(); })
      .def("mask",
           [](const ElasticHandle& h) {
             std::vector<int32_t> out(static_cast<size_t>(h.peers->config().capacity));
             h.peers->slots().query_mask(out.data(), out.size());
             return out;
           })
      .def("transport_of", [](const ElasticHandle& h,
                              int peer) { return std::string(h.peers->transport_of(peer)); })
      .def("events", [](const ElasticHandle& h) { return h.peers->events(); })
      .def(
          "watch_peers",
          [](ElasticHandle& h, const LossListenerBox& l) { h.peers->watch_peers(l.fn); },
          py::arg("listener"));
}

}  // namespace mooncake
