"""Device discovery without torch, selection, visibility and container views (kaitian/devices).

NVML is faked by a ``pynvml`` module object whose functions return what NVML
returns (the binding's own ctypes structures for PCI info, memory and
utilisation), for 1-, 2- and 8-GPU hosts; ``cnmon`` by a stand-in on PATH;
PCI sysfs and ``/dev`` by trees built in tmp dirs.
"""

from __future__ import annotations

import types

import pytest

pynvml = pytest.importorskip("pynvml")  # nvidia-ml-py, a dependency

from kaitian.devices import inventory  # noqa: E402
from kaitian.devices.device import Device, WorkerDevice  # noqa: E402
from kaitian.devices.rank import rank_device  # noqa: E402
from kaitian.devices.select import select  # noqa: E402
from kaitian.devices.vendors import utilisation, vendor  # noqa: E402
from kaitian.devices.vendors import cambricon, nvidia  # noqa: E402
from kaitian.devices.visible import torch_ordinal  # noqa: E402
from kaitian.errors import DeviceSelectionError  # noqa: E402
from kaitian.launcher.workers import node_workers  # noqa: E402
from kaitian.settings import Settings  # noqa: E402

# (name, memory.total bytes, bus id as NVML prints it, max PCIe gen, width, uuid)
H100_SXM = [
    ("NVIDIA H100 80GB HBM3", 85520809984, bus, 5, 16, f"GPU-{n}f3c2a1e-7d4b-5e6f-8a9b-0c1d2e3f4a5b")
    for n, bus in enumerate(
        ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
         "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0"]
    )
]
A100_PCIE = [("NVIDIA A100-PCIE-40GB", 42505273344, "00000000:3B:00.0", 4, 16,
              "GPU-6a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9")]
RTX_4090 = [
    ("NVIDIA GeForce RTX 4090", 25757220864, "00000000:01:00.0", 4, 16, "GPU-0d9e8f7a-6b5c-4d3e-2f1a-0b9c8d7e6f5a"),
    ("NVIDIA GeForce RTX 4090", 25757220864, "00000000:41:00.0", 4, 16, "GPU-1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f"),
]


def fake_nvml(gpus, *, lost=(), init_error=None, util=None):
    """A ``pynvml`` module answering as NVML does for these GPUs."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = pynvml.NVMLError
    state = {"init": 0}

    def init():
        if init_error is not None:
            raise init_error
        state["init"] += 1

    def shutdown():
        state["init"] -= 1

    def handle(i):
        if i in lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return ("handle", i)

    def pci(h):
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpus[h[1]][2].encode()
        return info

    def memory(h):
        m = pynvml.c_nvmlMemory_t()
        m.total = gpus[h[1]][1]
        return m

    def utilisation(h):
        u = pynvml.c_nvmlUtilization_t()
        u.gpu = (util or {}).get(h[1], 0)
        return u

    nv.nvmlInit = init
    nv.nvmlShutdown = shutdown
    nv.nvmlDeviceGetCount = lambda: len(gpus)
    nv.nvmlDeviceGetHandleByIndex = handle
    nv.nvmlDeviceGetName = lambda h: gpus[h[1]][0]
    nv.nvmlDeviceGetUUID = lambda h: gpus[h[1]][5]
    nv.nvmlDeviceGetPciInfo = pci
    nv.nvmlDeviceGetMemoryInfo = memory
    nv.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: gpus[h[1]][3]
    nv.nvmlDeviceGetMaxPcieLinkWidth = lambda h: gpus[h[1]][4]
    nv.nvmlDeviceGetUtilizationRates = utilisation
    nv.state = state
    return nv


@pytest.fixture
def no_tools(tmp_path, monkeypatch):
    """A PATH without nvidia-smi or cnmon, no host visibility variables, no real /dev nodes."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for var in ("CUDA_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES", "USE_CUDA", "USE_MLU", "USE_CPU",
                "KAITIAN_FAKE_ACCELERATOR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cambricon, "DEV_ROOT", str(tmp_path / "no-dev"))
    for module in (nvidia, cambricon):
        monkeypatch.setattr(module, "PCI_ROOT", str(tmp_path / "no-sys"))
    return empty


def use_nvml(monkeypatch, gpus, **kw):
    nv = fake_nvml(gpus, **kw)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nv)
    return nv


def pci_tree(root, functions):
    """``/sys/bus/pci/devices`` with (bus id, vendor, class, numa node, local_cpulist) entries."""
    for bus, vendor, pci_class, node, cpus in functions:
        d = root / bus
        d.mkdir(parents=True)
        (d / "vendor").write_text(f"0x{vendor:04x}\n")
        (d / "device").write_text("0x2330\n")
        (d / "class").write_text(f"0x{pci_class:06x}\n")
        (d / "numa_node").write_text(f"{node}\n")
        (d / "local_cpulist").write_text(f"{cpus}\n")
    return str(root)


# --- NVIDIA ---------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [A100_PCIE, RTX_4090, H100_SXM], ids=["1gpu", "2gpu", "8gpu"])
def test_nvml_probe_records_physical_index_uuid_bus_and_memory(gpus, monkeypatch, no_tools, tmp_path):
    nv = use_nvml(monkeypatch, gpus)
    found = nvidia.probe(sys_root=str(tmp_path / "no-sys"))
    assert [d.key for d in found] == [f"cuda:{i}" for i in range(len(gpus))]
    for d, (name, mem, bus, gen, width, uuid) in zip(found, gpus):
        assert (d.name, d.memory_bytes, d.uuid, d.source) == (name, mem, uuid, "nvml")
        assert d.bus_id == "0000:" + bus.split(":", 1)[1].lower()
        assert d.link == f"PCIe{gen} x{width}"
    assert nv.state["init"] == 0  # every nvmlInit has its nvmlShutdown


def test_nvml_devices_get_their_near_cores_from_sysfs(monkeypatch, no_tools, tmp_path):
    use_nvml(monkeypatch, RTX_4090)
    root = pci_tree(tmp_path / "pci", [("0000:01:00.0", 0x10DE, 0x030000, 0, "0-7"),
                                       ("0000:41:00.0", 0x10DE, 0x030000, 1, "8-15")])
    found = nvidia.probe(sys_root=root)
    assert [d.cpus for d in found] == [tuple(range(8)), tuple(range(8, 16))]


def test_a_lost_gpu_is_left_out_and_the_others_keep_their_index(monkeypatch, no_tools, tmp_path):
    use_nvml(monkeypatch, H100_SXM[:3], lost={1})
    assert [d.key for d in nvidia.probe(sys_root=str(tmp_path))] == ["cuda:0", "cuda:2"]


def test_without_the_nvml_library_sysfs_finds_the_gpus_not_their_audio(monkeypatch, no_tools, tmp_path):
    use_nvml(monkeypatch, H100_SXM, init_error=pynvml.NVMLError_LibraryNotFound(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    root = pci_tree(tmp_path / "pci", [
        ("0000:41:00.0", 0x10DE, 0x030000, 1, "8-15"),  # found second: bus order, not listing order
        ("0000:01:00.1", 0x10DE, 0x040300, 0, "0-7"),   # the GPU's HDMI audio function
        ("0000:01:00.0", 0x10DE, 0x030200, 0, "0-7"),   # 3D controller
        ("0000:02:00.0", 0x8086, 0x030000, 0, "0-7"),   # another vendor's GPU
    ])
    found = nvidia.probe(sys_root=root)
    assert [(d.key, d.bus_id, d.source) for d in found] == [
        ("cuda:0", "0000:01:00.0", "sysfs"), ("cuda:1", "0000:41:00.0", "sysfs")]
    assert found[1].cpus == tuple(range(8, 16)) and found[0].uuid is None


def test_without_the_binding_nvidia_smi_answers(monkeypatch, no_tools, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import pynvml -> ImportError
    fake = no_tools / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "echo '0, NVIDIA A100-PCIE-40GB, 40536, 00000000:3B:00.0, 4, 16, GPU-6a1b2c3d-4e5f'\n")
    fake.chmod(0o755)
    (d,) = nvidia.probe(sys_root=str(tmp_path))
    assert (d.key, d.uuid, d.bus_id, d.source) == ("cuda:0", "GPU-6a1b2c3d-4e5f", "0000:3b:00.0", "nvidia-smi")


def test_utilisation_comes_from_nvml(monkeypatch, no_tools):
    use_nvml(monkeypatch, RTX_4090, util={0: 37, 1: 99})
    assert utilisation(["cuda", "cpu"]) == {"cuda:0": 37.0, "cuda:1": 99.0}


# --- Cambricon ------------------------------------------------------------------------


def cnmon_info(cards):
    """``cnmon info`` text for (product, memory MiB, bus id, uuid) cards."""
    out = []
    for i, (product, mib, bus, uuid) in enumerate(cards):
        out += [f"Card {i}", f"Product Name                   : {product}",
                f"UUID                           : {uuid}",
                "PCIe info", f"    Bus Id                     : {bus}",
                "Physical Memory Usage", f"    Total                      : {mib} MiB",
                "    Used                       : 0 MiB"]
    return "\n".join(out) + "\n"


MLU370 = [("MLU370-X8", 24576, f"0000:{b}:00.0", f"MLU-{i:02d}a1b2c3d4e5f6")
          for i, b in enumerate(["1a", "1b", "3d", "3e", "9a", "9b", "b1", "b2"])]


@pytest.mark.parametrize("n", [1, 2, 8])
def test_cnmon_probe(n, no_tools, tmp_path):
    fake = no_tools / "cnmon"
    (tmp_path / "info.txt").write_text(cnmon_info(MLU370[:n]))
    fake.write_text(f"#!/bin/sh\nexec /bin/cat {tmp_path / 'info.txt'}\n")
    fake.chmod(0o755)
    found = cambricon.probe(sys_root=str(tmp_path / "no-sys"))
    assert [d.key for d in found] == [f"mlu:{i}" for i in range(n)]
    assert [(d.name, d.memory_bytes, d.bus_id, d.uuid) for d in found] == [
        (p, mib << 20, bus, uuid) for p, mib, bus, uuid in MLU370[:n]]


def test_mlu_device_nodes_then_sysfs(no_tools, tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("cambricon_ctl", "cambricon_dev0", "cambricon_dev3", "cambricon_ipcm0"):
        (dev / name).touch()
    assert [d.key for d in cambricon.probe(sys_root=str(tmp_path), dev_root=str(dev))] == ["mlu:0", "mlu:3"]
    root = pci_tree(tmp_path / "pci", [("0000:3d:00.0", 0xCABC, 0x120000, 0, "0-3")])
    (d,) = cambricon.probe(sys_root=root, dev_root=str(tmp_path / "none"))
    assert (d.key, d.bus_id, d.source) == ("mlu:0", "0000:3d:00.0", "sysfs")


def test_fake_mlus_stand_in_for_the_hardware_unless_torch_mlu_is_real(no_tools, tmp_path, monkeypatch):
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "cambricon_dev5").touch()
    monkeypatch.setenv("KAITIAN_FAKE_ACCELERATOR", "mlu:3")
    found = cambricon.probe(dev_root=str(dev))
    assert [(d.key, d.name, d.source) for d in found] == [
        (f"mlu:{i}", "fake MLU", "KAITIAN_FAKE_ACCELERATOR") for i in range(3)]
    monkeypatch.setenv("MLU_VISIBLE_DEVICES", "2,0")
    assert [d.key for d in inventory.discover() if d.type == "mlu"] == ["mlu:2", "mlu:0"]
    monkeypatch.setattr(cambricon, "_real_torch_mlu", lambda: True)
    assert [d.key for d in cambricon.probe(dev_root=str(dev))] == ["mlu:5"]


# --- visibility and selection ------------------------------------------------------------


def test_host_cuda_visible_devices_keeps_physical_indices(monkeypatch, no_tools):
    use_nvml(monkeypatch, H100_SXM)
    uuid5 = H100_SXM[5][5]

    def keys(visible):
        return [d.key for d in inventory.discover(env={"CUDA_VISIBLE_DEVICES": visible}) if d.type == "cuda"]

    assert keys("2,3") == ["cuda:2", "cuda:3"]
    assert keys("3,1") == ["cuda:3", "cuda:1"]  # CUDA's order
    assert keys(f"{uuid5},0") == ["cuda:5", "cuda:0"]  # UUIDs as CUDA takes them
    assert keys(uuid5[:12]) == ["cuda:5"]  # a unique prefix
    assert keys("1,9,2") == ["cuda:1"]  # as CUDA: an unknown entry ends the list
    assert keys("") == []


def test_plan_for_use_cuda_1_3_carries_physical_index_and_uuid(monkeypatch, no_tools):
    use_nvml(monkeypatch, H100_SXM[:4])
    workers = node_workers(nproc_auto=True, nproc_per_node=None, env={"USE_CUDA": "1,3"}).workers
    assert [(w.device.key, w.device.uuid) for w in workers] == [
        ("cuda:1", H100_SXM[1][5]), ("cuda:3", H100_SXM[3][5])]
    assert Settings.for_device(workers[1].device).to_env() == {
        "KAITIAN_DEVICE_TYPE": "cuda", "KAITIAN_DEVICE_INDEX": "3", "KAITIAN_DEVICE_UUID": H100_SXM[3][5]}


def test_plan_under_host_cuda_visible_devices_2_3(monkeypatch, no_tools):
    use_nvml(monkeypatch, H100_SXM[:4])
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    workers = node_workers(nproc_auto=True, nproc_per_node=None, env=env).workers
    assert [(w.device.index, w.device.uuid) for w in workers] == [(2, H100_SXM[2][5]), (3, H100_SXM[3][5])]
    # a local worker inherits CUDA_VISIBLE_DEVICES=2,3: torch's cuda:0 is GPU 2
    assert [torch_ordinal(w.device, "CUDA_VISIBLE_DEVICES", env) for w in workers] == [0, 1]
    with pytest.raises(DeviceSelectionError, match="no such device 0"):
        node_workers(nproc_auto=True, nproc_per_node=None, env={**env, "USE_CUDA": "0"})


def test_a_request_that_matches_nothing_is_an_error():
    host = [Device("cpu", 0, "cores", cpus=(0,))]
    with pytest.raises(DeviceSelectionError, match=r"^--devices cuda: no cuda device found on this host \(looked in NVML"):
        select(host, env={}, flag={"cuda": "all"})
    for value, says in (("0", "no such device 0: "), ("1,3", "no such device 1, 3: "), ("all", "")):
        with pytest.raises(DeviceSelectionError, match=f"^USE_CUDA={value}: {says}no cuda device found"):
            select(host, env={"USE_CUDA": value})
    assert select(host, env={}) == host  # nothing asked: the CPU, as before
    assert select(host, env={"USE_CUDA": "-1"}) == host


# --- the worker's ordinal and the container's view ----------------------------------------


def test_torch_ordinal_rules():
    d3 = WorkerDevice("cuda", 3, uuid="GPU-3333-aaaa")
    assert torch_ordinal(d3, "CUDA_VISIBLE_DEVICES", {}) == 3  # nothing hidden: physical = ordinal
    assert torch_ordinal(d3, "CUDA_VISIBLE_DEVICES", {"CUDA_VISIBLE_DEVICES": "1,3"}) == 1
    assert torch_ordinal(d3, "CUDA_VISIBLE_DEVICES", {"CUDA_VISIBLE_DEVICES": "GPU-1111,GPU-3333"}) == 1
    assert torch_ordinal(d3, "CUDA_VISIBLE_DEVICES", {"CUDA_VISIBLE_DEVICES": "7"}) == 0  # one left
    with pytest.raises(DeviceSelectionError, match="not visible"):
        torch_ordinal(d3, "CUDA_VISIBLE_DEVICES", {"CUDA_VISIBLE_DEVICES": "0,1"})
    inside = {"CUDA_VISIBLE_DEVICES": "0,1", "KAITIAN_VISIBLE_INDICES": "1,3"}
    assert torch_ordinal(d3, "CUDA_VISIBLE_DEVICES", inside) == 1


def test_cuda_container_requests_gpus_by_uuid_and_the_worker_finds_its_own():
    devices = [WorkerDevice("cuda", 3, uuid="GPU-3"), WorkerDevice("cuda", 1, uuid="GPU-1")]
    seen = vendor("cuda").container_devices(devices)
    assert seen.device_requests == ({"driver": "nvidia", "device_ids": ["GPU-1", "GPU-3"],
                                     "capabilities": [["gpu"]]},)
    assert seen.env == {"CUDA_VISIBLE_DEVICES": "GPU-1,GPU-3"}
    assert dict(seen.index_map) == {1: 0, 3: 1} and seen.visible_indices == (1, 3)
    assert torch_ordinal(devices[0], "CUDA_VISIBLE_DEVICES", seen.env) == 1
    by_index = vendor("cuda").container_devices([WorkerDevice("cuda", 2)])
    assert by_index.device_requests[0]["device_ids"] == ["2"]
    assert by_index.env["CUDA_VISIBLE_DEVICES"] == "0" and by_index.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert vendor("cpu").container_devices([WorkerDevice("cpu", 0)]).device_requests == ()


def test_mlu_container_gets_its_nodes_and_renumbered_visibility():
    present = ["/dev/cambricon_ctl", "/dev/cambricon_dev1", "/dev/cambricon_dev3", "/dev/cambricon_ipcm3"]
    seen = vendor("mlu").container_devices([WorkerDevice("mlu", 3), WorkerDevice("mlu", 1)], present)
    assert seen.device_nodes == ("/dev/cambricon_ctl:/dev/cambricon_ctl:rwm",
                                 "/dev/cambricon_dev1:/dev/cambricon_dev1:rwm",
                                 "/dev/cambricon_dev3:/dev/cambricon_dev3:rwm",
                                 "/dev/cambricon_ipcm3:/dev/cambricon_ipcm3:rwm")
    assert seen.env == {"MLU_VISIBLE_DEVICES": "0,1"} and seen.visible_indices == (1, 3)
    with pytest.raises(DeviceSelectionError, match="cambricon_dev2"):
        vendor("mlu").container_devices([WorkerDevice("mlu", 2)], present)


def test_rank_device_reads_the_launchers_variables():
    env = {"KAITIAN_DEVICE_TYPE": "cuda", "KAITIAN_DEVICE_INDEX": "3", "KAITIAN_DEVICE_UUID": "GPU-3"}
    assert rank_device(env) == WorkerDevice("cuda", 3, "cuda", "GPU-3")
    assert rank_device({**env, "KAITIAN_GROUP": "fast"}).group == "fast"
    assert Settings.from_env(Settings.for_device(rank_device(env)).to_env()).device == rank_device(env)
    assert Settings.for_device(WorkerDevice("cpu", 1, "cpu1")).to_env()["KAITIAN_GROUP"] == "cpu1"
    assert rank_device({"LOCAL_RANK": "1"}) == WorkerDevice("cpu", 0)  # no accelerator torch sees here


def test_planned_container_and_exec_give_the_worker_its_gpu():
    """USE_CUDA=1,3 in a container: GPUs by UUID, the exec's env lets worker 3 land on cuda:1."""
    from kaitian.launcher.workers import LocalWorker
    from kaitian.launcher.runtimes.base import RunContext
    from kaitian.launcher.runtimes.docker.start import AgentIdentity, DockerHost
    from kaitian.launcher.runtimes.docker.options import DockerOptions
    from kaitian.devices.visible import worker_visibility
    from kaitian.launcher.runtimes.docker.start import container_spec, exec_spec

    gpus = [WorkerDevice("cuda", 1, uuid=H100_SXM[1][5]), WorkerDevice("cuda", 3, uuid=H100_SXM[3][5])]
    workers = [LocalWorker(i, d) for i, d in enumerate(gpus)]
    host = DockerHost(RunContext("r", "/run/k", None, "/work"), AgentIdentity("h", 1, "0"), "0:0")
    container = container_spec("cuda", workers, host, DockerOptions())
    assert container.create_kwargs()["device_requests"][0]["device_ids"] == [H100_SXM[1][5], H100_SXM[3][5]]
    # the agent's env for worker 1, with what it sees of the container (kaitian.launcher.environment's last layer)
    env = {"CUDA_VISIBLE_DEVICES": "1,2,3", **Settings.for_device(gpus[1]).to_env(),
           **worker_visibility(gpus[1], container=container.devices)}
    ex = exec_spec(workers[1], container, ("python3", "t.py"), env, host)
    assert ex.env["CUDA_VISIBLE_DEVICES"] == f"{H100_SXM[1][5]},{H100_SXM[3][5]}"
    assert ex.env["KAITIAN_DEVICE_INDEX"] == "3" and ex.env["KAITIAN_VISIBLE_INDICES"] == "1,3"
    assert torch_ordinal(Settings.from_env(ex.env).device, "CUDA_VISIBLE_DEVICES", ex.env) == 1


@pytest.mark.parametrize(
    "env",
    [
        {"CUDA_VISIBLE_DEVICES": "2,3"},  # local, host CUDA_VISIBLE_DEVICES=2,3
        {"CUDA_VISIBLE_DEVICES": "GPU-2,GPU-3", "KAITIAN_DEVICE_UUID": "GPU-3"},  # local, UUIDs
        {"CUDA_VISIBLE_DEVICES": "GPU-1,GPU-3", "KAITIAN_VISIBLE_INDICES": "1,3"},  # container with GPUs 1, 3
    ],
    ids=["local-indices", "local-uuids", "container"],
)
def test_kaitian_device_lands_on_physical_gpu_3(monkeypatch, env):
    import torch

    import kaitian

    for var in ("CUDA_VISIBLE_DEVICES", "KAITIAN_VISIBLE_INDICES", "KAITIAN_DEVICE_UUID"):
        monkeypatch.delenv(var, raising=False)
    for k, v in {"KAITIAN_DEVICE_TYPE": "cuda", "KAITIAN_DEVICE_INDEX": "3", **env}.items():
        monkeypatch.setenv(k, v)
    assert kaitian.device() == torch.device("cuda:1")


def test_an_nvml_that_fails_after_init_falls_back(monkeypatch, no_tools, tmp_path):
    nv = use_nvml(monkeypatch, RTX_4090)

    def broken():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    nv.nvmlDeviceGetCount = broken
    root = pci_tree(tmp_path / "pci", [("0000:01:00.0", 0x10DE, 0x030000, 0, "0-7")])
    assert [(d.key, d.source) for d in nvidia.probe(sys_root=root)] == [("cuda:0", "sysfs")]
    assert nv.state["init"] == 0


def test_a_cuda_rank_never_imports_another_vendors_plug_in(monkeypatch):
    # counting MLUs imports torch_mlu, whose global monkeypatches (its Reducer,
    # ProcessGroupGloo, destroy_process_group) must not reach a CUDA rank (issue 16)
    import dataclasses

    from kaitian.devices import rank as rank_module

    counted = []

    def counter(name, n):
        return lambda: counted.append(name) or n

    table = {name: dataclasses.replace(v, count=counter(name, 2)) for name, v in rank_module.VENDORS.items()}
    monkeypatch.setattr(rank_module, "VENDORS", table)
    assert rank_device({}, rank=3) == WorkerDevice("cuda", 1, "cuda")
    assert set(counted) == {"cuda"}
