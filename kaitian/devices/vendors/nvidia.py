"""NVIDIA: devices through NVML (``nvidia-ml-py``), else ``nvidia-smi``, else PCI sysfs.

NVML is the library ``nvidia-smi`` itself reads; ``pynvml`` loads
``libnvidia-ml.so`` at run time, so discovery needs the driver but never
torch, and never creates a CUDA context in the agent. NVML numbers GPUs in
PCI bus order, ignoring ``CUDA_VISIBLE_DEVICES``: these are physical indices.
"""

from __future__ import annotations

import contextlib
import csv
import io
from typing import Dict, Iterator, List, Optional, Sequence

from kaitian.devices.device import ContainerDevices, Device, WorkerDevice
from kaitian.devices.vendors.pci import PCI_ROOT, find_function, normalise_bus_id, pci_functions
from kaitian.devices.vendors.tools import run_tool

__all__ = [
    "PCI_VENDOR", "SOURCES", "probe", "utilisation", "container_devices", "count", "set_device",
]

PCI_VENDOR = 0x10DE
_PCI_CLASSES = (0x03,)  # display controllers (VGA, 3D); not a GPU's audio or USB functions
SOURCES = "NVML (nvidia-ml-py), nvidia-smi, /sys/bus/pci"


# --- discovery ---------------------------------------------------------------


@contextlib.contextmanager
def nvml() -> Iterator[Optional[object]]:
    """The initialised ``pynvml`` module, or ``None`` (binding or driver library missing)."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no usable driver
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(call, *args) -> Optional[int]:
    """An NVML query a GPU may not support (link width on SXM parts) -> ``None``."""
    try:
        return int(call(*args))
    except Exception:
        return None


def _link(gen: Optional[int], width: Optional[int]) -> Optional[str]:
    return f"PCIe{gen} x{width}" if gen and width else None


def _near_cpus(bus_id: Optional[str], sys_root: str) -> tuple:
    function = find_function(bus_id, sys_root)
    return function.cpus if function else ()


def from_nvml(nv, sys_root: str = PCI_ROOT) -> List[Device]:
    """Every GPU NVML reports (a GPU NVML cannot open is left out, keeping the others' indices)."""
    devices = []
    for i in range(int(nv.nvmlDeviceGetCount())):
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            bus_id = normalise_bus_id(_text(nv.nvmlDeviceGetPciInfo(handle).busId))
            device = Device(
                type="cuda",
                index=i,
                name=_text(nv.nvmlDeviceGetName(handle)),
                memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(handle).total),
                bus_id=bus_id,
                link=_link(
                    _optional(nv.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                    _optional(nv.nvmlDeviceGetMaxPcieLinkWidth, handle),
                ),
                uuid=_text(nv.nvmlDeviceGetUUID(handle)),
                cpus=_near_cpus(bus_id, sys_root),
                source="nvml",
            )
        except Exception:  # e.g. NVMLError_GpuIsLost for one GPU
            continue
        devices.append(device)
    return devices


SMI_QUERY = "index,name,memory.total,pci.bus_id,pcie.link.gen.max,pcie.link.width.max,uuid"


def from_smi(out: str, sys_root: str = PCI_ROOT) -> List[Device]:
    """``nvidia-smi --query-gpu=<SMI_QUERY> --format=csv,noheader,nounits`` -> devices."""
    devices = []
    for row in csv.reader(io.StringIO(out)):
        if len(row) < 6 or not row[0].strip().isdigit():
            continue
        idx, name, mem, bus, gen, width = (x.strip() for x in row[:6])
        uuid = row[6].strip() if len(row) > 6 and row[6].strip() else None
        try:
            memory: Optional[int] = int(float(mem)) * (1 << 20)
        except ValueError:
            memory = None
        bus_id = normalise_bus_id(bus)
        devices.append(
            Device(
                "cuda", int(idx), name, memory, bus_id,
                _link(int(gen) if gen.isdigit() else None, int(width) if width.isdigit() else None),
                cpus=_near_cpus(bus_id, sys_root), uuid=uuid, source="nvidia-smi",
            )
        )
    return devices


def from_sysfs(sys_root: str = PCI_ROOT) -> List[Device]:
    """NVIDIA display functions in PCI sysfs, numbered in bus order as NVML numbers them."""
    return [
        Device("cuda", i, f"NVIDIA device {f.device_id}", bus_id=f.bus_id, cpus=f.cpus, source="sysfs")
        for i, f in enumerate(pci_functions(PCI_VENDOR, _PCI_CLASSES, sys_root))
    ]


def probe(sys_root: Optional[str] = None) -> List[Device]:
    """This host's GPUs, physical indices: NVML, else ``nvidia-smi``, else PCI sysfs."""
    sys_root = sys_root or PCI_ROOT
    with nvml() as nv:
        if nv is not None:
            try:
                return from_nvml(nv, sys_root)
            except Exception:  # NVML up but unusable (e.g. driver/library mismatch): ask the others
                pass
    out = run_tool(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"])
    if out is not None:
        return from_smi(out, sys_root)
    return from_sysfs(sys_root)


# --- utilisation ---------------------------------------------------------------


def utilisation() -> Dict[int, float]:
    """Physical index -> GPU utilisation in percent (NVML, else ``nvidia-smi``; empty without either)."""
    found: Dict[int, float] = {}
    with nvml() as nv:
        if nv is not None:
            for i in range(int(nv.nvmlDeviceGetCount())):
                try:
                    found[i] = float(nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByIndex(i)).gpu)
                except Exception:
                    continue
            return found
    out = run_tool(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"], 5.0)
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                found[int(parts[0])] = float(parts[1])
            except ValueError:
                pass
    return found


# --- containers ------------------------------------------------------------------


def container_devices(devices: Sequence[WorkerDevice], present_nodes=None) -> ContainerDevices:
    """An NVIDIA device request for exactly these GPUs, and the container's view of them.

    GPUs are requested by UUID where known (stable, whatever the host's
    numbering), else by physical index. Inside, ``CUDA_VISIBLE_DEVICES`` lists
    them in physical-index order (by UUID, or renumbered 0.. in PCI bus order),
    so torch's ordinal ``k`` is the ``k``-th of ``KAITIAN_VISIBLE_INDICES``.
    """
    ordered = sorted({d.index: d for d in devices}.values(), key=lambda d: d.index)
    if not ordered:
        return ContainerDevices()
    ids = [d.uuid or str(d.index) for d in ordered]
    if all(d.uuid for d in ordered):
        env = {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
    else:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(k) for k in range(len(ordered))),
               "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's default order may differ from NVML's
    return ContainerDevices(
        device_requests=({"driver": "nvidia", "device_ids": ids, "capabilities": [["gpu"]]},),
        env=env,
        index_map={d.index: k for k, d in enumerate(ordered)},
    )


# --- the worker side (torch) ----------------------------------------------------------


def count() -> int:
    """GPUs torch sees in this process (after ``CUDA_VISIBLE_DEVICES``)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def set_device(index: int) -> None:
    import torch

    torch.cuda.set_device(index)
