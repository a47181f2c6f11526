"""The vendor table: everything kaitian knows about a device type, in one entry each.

The C++ backend never links a vendor library; what differs between vendors
lives here. Each vendor's module (:mod:`.nvidia`, :mod:`.cambricon`,
:mod:`.cpu`) holds its hooks: the *probe* that finds its devices without
torch, its *utilisation* reading, its *container* hook (what a container needs
to see a set of devices) and the worker-side torch calls. Adding a vendor is
one module and one ``Vendor`` entry in ``VENDORS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from kaitian.devices.device import ContainerDevices, Device, WorkerDevice
from kaitian.devices.vendors import cambricon, cpu, nvidia
from kaitian.devices.vendors.tools import has_tool, run_tool
from kaitian.errors import UnknownVendorError

__all__ = [
    "Vendor", "VENDORS", "vendor", "vendor_names", "intra_gaps", "utilisation", "UnknownVendorError",
    "has_tool", "run_tool",
]

ContainerHook = Callable[[Sequence[WorkerDevice], Optional[Iterable[str]]], ContainerDevices]


@dataclass(frozen=True)
class Vendor:
    """One device type and how to find, watch and drive it.

    Attributes:
        name: device type, as in ``torch.device(name)`` and ``KAITIAN_DEVICE_TYPE``.
        selector_env: the variable that selects devices (``USE_CUDA``).
        intra_backend: torch distributed backend used inside a group of this type.
        visible_env: the vendor's visibility variable, or ``None``.
        load: imports the vendor's torch plug-in (``torch_mlu``), if the
            device type needs one.
        image: default container image for ``--runtime docker``.
        count: number of devices of this type torch sees in this process (workers).
        set_device: makes a torch ordinal current for the process.
        probe: this host's devices, physical indices, found without torch
            (``None``: the type has no hardware to find, as the CPU).
        sources: where ``probe`` looks, for error messages.
        utilisation: physical index -> utilisation percent, now.
        container: what a container needs to see exactly some devices.
        intra_gaps: what ``intra_backend`` cannot reduce (dtype and ReduceOp
            names): such reductions skip the group's vendor and go through the
            bridge, which reduces every dtype and op, instead of failing or
            being silently rounded.
    """

    name: str
    selector_env: str
    intra_backend: str
    visible_env: Optional[str]
    load: Optional[Callable[[], None]]
    image: str
    count: Callable[[], int]
    set_device: Optional[Callable[[int], None]] = None
    aliases: tuple = field(default=())
    probe: Optional[Callable[[], List[Device]]] = None
    sources: str = ""
    utilisation: Optional[Callable[[], Dict[int, float]]] = None
    container: Optional[ContainerHook] = None
    intra_gaps: frozenset = frozenset()

    def torch_device(self, index: Optional[int] = None) -> str:
        """The torch device string for a torch ordinal (``cuda:1``, ``cpu``)."""
        if self.name == "cpu" or index is None:
            return self.name
        return f"{self.name}:{index}"

    def import_module(self) -> None:
        """Imports the vendor's torch plug-in (``torch_mlu``) if it needs one."""
        if self.load is not None:
            self.load()

    def container_devices(
        self, devices: Sequence[WorkerDevice], present_nodes: Optional[Iterable[str]] = None
    ) -> ContainerDevices:
        """What a container needs to see exactly ``devices`` (of this type): device
        requests, device nodes and environment; empty for a type without hardware.

        Args:
            devices: the workers' devices (physical indices, UUIDs where known).
            present_nodes: device nodes on this host (default: look in ``/dev``).

        Raises:
            DeviceSelectionError: a device the container needs is missing here.
        """
        if self.container is None:
            return ContainerDevices()
        return self.container(devices, present_nodes)


# gloo's type switch has neither int16 nor bool.
GLOO_GAPS = frozenset({"int16", "bool"})
# NCCL has no int16 type and no bitwise ops; torch turns a bool SUM into MAX.
NCCL_GAPS = frozenset({"int16", "bool", "BAND", "BOR", "BXOR"})
# CNCL (torch_mlu's ProcessGroupCNCL) has no int16 type and no bitwise ops, and
# no float64: torch_mlu maps kDouble to cnclFloat, which would round every
# element to float32. It carries bool as uint8 (a bool SUM becomes MAX), so bool
# is no gap of its own (device groups avoid it anyway: gloo lacks it). The fake
# accelerator's cncl backend refuses exactly these (tests/backend/test_collectives.py).
CNCL_GAPS = frozenset({"int16", "float64", "BAND", "BOR", "BXOR"})

VENDORS: Dict[str, Vendor] = {
    v.name: v
    for v in (
        Vendor(
            name="cuda",
            selector_env="USE_CUDA",
            intra_backend="nccl",
            visible_env="CUDA_VISIBLE_DEVICES",
            load=None,
            image="kaitian:cuda",
            count=nvidia.count,
            set_device=nvidia.set_device,
            probe=nvidia.probe,
            sources=nvidia.SOURCES,
            utilisation=nvidia.utilisation,
            container=nvidia.container_devices,
            intra_gaps=NCCL_GAPS,
        ),
        Vendor(
            name="mlu",
            selector_env="USE_MLU",
            intra_backend="cncl",
            visible_env="MLU_VISIBLE_DEVICES",
            load=cambricon.load_torch_mlu,
            image="kaitian:mlu",
            count=cambricon.count,
            set_device=cambricon.set_device,
            probe=cambricon.probe,
            sources=cambricon.SOURCES,
            utilisation=cambricon.utilisation,
            container=cambricon.container_devices,
            intra_gaps=CNCL_GAPS,
        ),
        Vendor(
            name="cpu",
            selector_env="USE_CPU",
            intra_backend="gloo",
            visible_env=None,
            load=None,
            image="kaitian:cpu",
            count=cpu.count,
            sources=cpu.SOURCES,
            intra_gaps=GLOO_GAPS,
        ),
    )
}


def vendor(name: str) -> Vendor:
    """Looks a device type up in the table.

    Raises:
        UnknownVendorError: the name is not a known device type.
    """
    try:
        return VENDORS[name]
    except KeyError:
        raise UnknownVendorError(
            f"unknown device type {name!r}; known: {', '.join(VENDORS)}"
        ) from None


def vendor_names() -> List[str]:
    """Device types in layout order (accelerators first, CPU last)."""
    return list(VENDORS)


def intra_gaps(device: str, intra_backend: str) -> frozenset:
    """What a group's reductions must not ask of its vendor (:attr:`Vendor.intra_gaps`).

    A reduction whose dtype or op is listed for a group skips that group's
    vendor: its ranks take part in the bridge one by one, which reduces every
    dtype and op. Data movement avoids only the listed dtypes (and otherwise
    goes through the bridge anyway, unless one vendor group is the whole world).

    Args:
        device: the group's device type (``cuda``, ``cpu``, ...).
        intra_backend: the backend used inside the group (``nccl``, ``gloo``).

    Returns:
        Dtype and ReduceOp names. A device group's CPU tensors go through gloo,
        and no other rank knows which device a group's tensors are on, so a
        device group avoids gloo's gaps too (every rank must route alike). A
        vendor not in the table is assumed to lack what NCCL lacks.
    """
    gloo = VENDORS["cpu"].intra_gaps
    if device == "cpu" or intra_backend == "gloo":
        return gloo
    known = VENDORS.get(device)
    return (known.intra_gaps if known is not None else VENDORS["cuda"].intra_gaps) | gloo


def utilisation(device_types: Iterable[str]) -> Dict[str, float]:
    """``{"cuda:0": percent, ...}`` (physical indices) for the devices of these
    types, from each vendor's utilisation hook (empty where unknown), for
    ``kaitianrun --monitor``."""
    found: Dict[str, float] = {}
    for kind in set(device_types):
        v = VENDORS.get(kind)
        if v is None or v.utilisation is None:
            continue
        try:
            readings = v.utilisation()
        except Exception:  # the monitor must never take the job down
            continue
        found.update({f"{kind}:{index}": percent for index, percent in readings.items()})
    return found
