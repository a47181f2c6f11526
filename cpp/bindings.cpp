// Python module kaitian._C: the backend factory and a little introspection.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <mutex>

#include "backend.hpp"
#include "tcp_mesh.hpp"
#include "sha256.hpp"
#include "shm_bridge.hpp"
#include "tcp_bridge.hpp"

namespace py = pybind11;
using namespace kaitian;

namespace {

// Live backends, shut down at interpreter exit (kaitian.backend.factory
// registers shutdownLiveBackends with atexit): a script may end without
// destroy_process_group(), and an op thread that drops the last reference to
// a Python-owned tensor after finalization began would be killed by Python
// while unwinding a noexcept destructor (std::terminate).
std::mutex gLiveMu;
std::vector<c10::weak_intrusive_ptr<KaitianBackend>> gLive;

c10::intrusive_ptr<KaitianBackend> remember(c10::intrusive_ptr<KaitianBackend> backend) {
  std::lock_guard<std::mutex> lock(gLiveMu);
  gLive.erase(std::remove_if(gLive.begin(), gLive.end(), [](const auto& w) { return w.expired(); }),
              gLive.end());
  gLive.emplace_back(backend);
  return backend;
}

void shutdownLiveBackends() {
  std::vector<c10::intrusive_ptr<KaitianBackend>> live;
  {
    std::lock_guard<std::mutex> lock(gLiveMu);
    for (const auto& w : gLive) {
      if (auto b = w.lock()) live.push_back(std::move(b));
    }
    gLive.clear();
  }
  py::gil_scoped_release nogil;  // the op threads may need the GIL to finish
  for (const auto& b : live) b->shutdown();
}

c10::intrusive_ptr<c10d::Backend> optionalBackend(const py::object& o) {
  if (o.is_none()) return {};
  return o.cast<c10::intrusive_ptr<c10d::Backend>>();
}

// `bridge`: ShmBridgeOptions or MeshOptions (TCP).
c10::intrusive_ptr<KaitianBackend> createBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                 int size, int64_t timeoutMs, Layout layout,
                                                 const py::object& bridge, const py::object& intraDevice,
                                                 const py::object& intraCpu) {
  const std::chrono::milliseconds timeout(timeoutMs);
  auto devBackend = optionalBackend(intraDevice);
  auto cpuBackend = optionalBackend(intraCpu);
  const bool tcp = py::isinstance<MeshOptions>(bridge);
  TORCH_CHECK(tcp || py::isinstance<ShmBridgeOptions>(bridge),
              "kaitian: bridge options must be ShmBridgeOptions or TcpBridgeOptions");
  std::unique_ptr<Bridge> made;
  if (tcp) {
    const auto mesh = bridge.cast<MeshOptions>();
    py::gil_scoped_release nogil;  // peers meet through stores: this blocks
    made = std::make_unique<TcpBridge>(store, rank, size, mesh, timeout);
  } else {
    auto shm = bridge.cast<ShmBridgeOptions>();
    py::gil_scoped_release nogil;
    made = std::make_unique<ShmBridge>(rank, size, std::move(shm), timeout);
  }
  return remember(c10::make_intrusive<KaitianBackend>(rank, size, timeout, std::move(layout), devBackend,
                                                      cpuBackend, std::move(made)));
}

void joinWithoutGil(const std::function<void()>& join) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release nogil;
    join();
  } else {
    join();
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kaitian C++ backend";
  py::module_::import("torch.distributed");  // registers c10d::Backend / Store with pybind
  kaitian::setBlockingHook(&joinWithoutGil);
  py::class_<KaitianBackend, c10d::Backend, c10::intrusive_ptr<KaitianBackend>>(m, "KaitianBackend")
      .def("bridge_kind", &KaitianBackend::bridgeKind)
      .def("staged_bytes", &KaitianBackend::stagedBytes)
      .def("has_intra", &KaitianBackend::hasIntra)
      .def("group_of", [](const KaitianBackend& b) { return b.layout().groupOf; })
      .def("group_names", [](const KaitianBackend& b) { return b.layout().groupNames; })
      .def("flat_intra", [](const KaitianBackend& b) { return b.layout().flatIntra; })
      // The group's first failure once it is broken, else "" (kaitian.elastic tells a
      // lost peer from a script error by it).
      .def("first_failure", &KaitianBackend::firstFailure)
      // A benched rank's check on the rank it waits for (kaitian.training.rebalance).
      .def("watch_peer", &KaitianBackend::watchPeer, py::arg("peer"), py::arg("what"))
      // Hot spares away from the group's collectives (kaitian.training.rebalance).
      .def("set_away", &KaitianBackend::setAway, py::arg("why"))
      // Stripe weights of the cross-group reduction (kaitian.backend.stripes).
      .def("set_stripe_weights", &KaitianBackend::setStripeWeights, py::arg("weights"))
      .def("stripe_weights", &KaitianBackend::stripeWeights)
      .def("reduce_rate", &KaitianBackend::reduceRate)
      .def("kaitian_shutdown", &KaitianBackend::shutdown,
           py::call_guard<py::gil_scoped_release>())
#if !KAITIAN_BACKEND_HAS_SET_TIMEOUT  // torch < 2.9 binds no Backend.set_timeout
      .def("set_timeout", &KaitianBackend::setTimeout, py::arg("timeout"))
#endif
      ;
  py::class_<Layout>(m, "Layout", "The world as every rank sees it (see cpp/backend.hpp).")
      .def(py::init([](std::vector<int> groupOf, std::vector<std::string> groupNames,
                       std::vector<std::string> groupDevice, bool flatIntra, int64_t segmentBytes,
                       std::vector<std::vector<std::string>> vendorGaps, std::optional<c10::Device> device) {
             return Layout{std::move(groupOf), std::move(groupNames), std::move(groupDevice), flatIntra,
                           segmentBytes, std::move(vendorGaps), device};
           }),
           py::arg("group_of"), py::arg("group_names"), py::arg("group_device"), py::arg("flat_intra") = true,
           py::arg("segment_bytes") = int64_t{16} << 20,
           py::arg("vendor_gaps") = std::vector<std::vector<std::string>>{}, py::arg("device") = py::none());
  py::class_<ShmBridgeOptions>(m, "ShmBridgeOptions", "The shared-memory bridge: where ranks meet, the segment.")
      .def(py::init([](c10::intrusive_ptr<c10d::Store> store, std::string name, int64_t chunkBytes,
                       std::vector<int64_t> pids, int64_t spinMicros) {
             return ShmBridgeOptions{std::move(store), std::move(name), chunkBytes, std::move(pids), spinMicros};
           }),
           py::arg("store"), py::arg("name"), py::arg("chunk_bytes"), py::arg("pids"), py::arg("spin_us") = 50);
  py::class_<MeshOptions>(m, "TcpBridgeOptions", "The TCP bridge: listen address, job key, session, port range.")
      .def(py::init([](std::string host, const py::bytes& key, std::string session, std::pair<int, int> ports) {
             return MeshOptions{std::move(host), std::string(key), std::move(session), ports.first, ports.second};
           }),
           py::arg("host"), py::arg("key"), py::arg("session"), py::arg("ports") = std::make_pair(0, 0));
  m.def("create_backend", &createBackend, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout_ms"), py::arg("layout"), py::arg("bridge"), py::arg("intra_device") = py::none(),
        py::arg("intra_cpu") = py::none());
  m.def("shutdown_live_backends", &shutdownLiveBackends,
        "Shuts down every kaitian backend still alive (registered with atexit).");
  // The inter-host bridge's wire version; nodes compare it before any worker starts.
  m.attr("BRIDGE_PROTOCOL") = kTcpProtocolVersion;
  // For tests: the HMAC the TCP handshake uses.
  m.def("_hmac_sha256", [](const py::bytes& key, const py::bytes& msg) {
    const Digest d = hmacSha256(std::string(key), std::string(msg));
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
}
