// Python module kaitian._C: the backend factory and a little introspection.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "backend.hpp"
#include "tcp_mesh.hpp"
#include "sha256.hpp"
#include "shm_bridge.hpp"
#include "tcp_bridge.hpp"

namespace py = pybind11;
using namespace kaitian;

namespace {

c10::intrusive_ptr<c10d::Backend> optionalBackend(const py::object& o) {
  if (o.is_none()) return {};
  return o.cast<c10::intrusive_ptr<c10d::Backend>>();
}

c10::intrusive_ptr<KaitianBackend> createBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int64_t timeoutMs,
    std::vector<int> groupOf, std::vector<std::string> groupNames,
    std::vector<std::string> groupDevice, bool flatIntra, const py::object& intraDevice,
    const py::object& intraCpu, const std::string& bridgeKind, const py::object& bridgeStore,
    const std::string& uid, int64_t chunkBytes, std::vector<int64_t> pids,
    const std::string& tcpHost, int64_t spinMicros, int64_t segmentBytes,
    std::vector<std::vector<std::string>> vendorGaps, const py::bytes& tcpKey,
    const std::string& tcpSession, std::pair<int, int> tcpPorts) {
  const std::chrono::milliseconds timeout(timeoutMs);
  auto devBackend = optionalBackend(intraDevice);
  auto cpuBackend = optionalBackend(intraCpu);
  c10::intrusive_ptr<c10d::Store> meet;
  if (bridgeKind == "shm") meet = bridgeStore.cast<c10::intrusive_ptr<c10d::Store>>();
  TORCH_CHECK(bridgeKind == "shm" || bridgeKind == "tcp", "kaitian: unknown bridge kind ",
              bridgeKind, " (expected shm or tcp)");
  const MeshOptions mesh{tcpHost, std::string(tcpKey), tcpSession, tcpPorts.first, tcpPorts.second};
  std::unique_ptr<Bridge> bridge;
  {
    py::gil_scoped_release nogil;  // peers meet through stores: this blocks
    if (bridgeKind == "tcp") {
      bridge = std::make_unique<TcpBridge>(store, rank, size, mesh, timeout);
    } else {
      bridge = std::make_unique<ShmBridge>(meet, rank, size, uid, chunkBytes, std::move(pids),
                                           timeout, spinMicros);
    }
  }
  Layout layout{std::move(groupOf), std::move(groupNames), std::move(groupDevice), flatIntra,
                segmentBytes, std::move(vendorGaps)};
  return c10::make_intrusive<KaitianBackend>(rank, size, timeout, std::move(layout), devBackend,
                                             cpuBackend, std::move(bridge));
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
      .def("bridge_regions", &KaitianBackend::bridgeRegions)
      .def("has_intra", &KaitianBackend::hasIntra)
      .def("group_of", [](const KaitianBackend& b) { return b.layout().groupOf; })
      .def("group_names", [](const KaitianBackend& b) { return b.layout().groupNames; })
      .def("flat_intra", [](const KaitianBackend& b) { return b.layout().flatIntra; })
      .def("kaitian_shutdown", &KaitianBackend::shutdown,
           py::call_guard<py::gil_scoped_release>())
#if !KAITIAN_BACKEND_HAS_SET_TIMEOUT  // torch < 2.9 binds no Backend.set_timeout
      .def("set_timeout", &KaitianBackend::setTimeout, py::arg("timeout"))
#endif
      ;
  m.def("create_backend", &createBackend, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout_ms"), py::arg("group_of"), py::arg("group_names"),
        py::arg("group_device"), py::arg("flat_intra"), py::arg("intra_device"),
        py::arg("intra_cpu"), py::arg("bridge_kind"), py::arg("bridge_store"), py::arg("shm_name"),
        py::arg("chunk_bytes"), py::arg("pids"), py::arg("tcp_host"), py::arg("spin_us") = 50,
        py::arg("segment_bytes") = int64_t{16} << 20,
        py::arg("vendor_gaps") = std::vector<std::vector<std::string>>{},
        py::arg("tcp_key") = py::bytes(), py::arg("tcp_session") = "",
        py::arg("tcp_ports") = std::make_pair(0, 0));
  // The inter-host bridge's wire version; nodes compare it before any worker starts.
  m.attr("BRIDGE_PROTOCOL") = kTcpProtocolVersion;
  // For tests: the HMAC the TCP handshake uses.
  m.def("_hmac_sha256", [](const py::bytes& key, const py::bytes& msg) {
    const Digest d = hmacSha256(std::string(key), std::string(msg));
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
}
