"""The vendor table: everything kaitian knows about a device type, in one entry each.

The C++ backend never links a vendor library; what differs between vendors
lives here. Each vendor's module (:mod:`.nvidia`, :mod:`.cambricon`,
:mod:`.cpu`) holds its hooks: the *probe* that finds its devices without
torch, its *utilisation* reading, its *container* hook (what a container needs
to see a set of devices) and the worker-side torch calls. Adding a vendor is
one module and one ``Vendor`` entry in ``VENDORS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from kaitian.devices.device import ContainerDevices, Device, WorkerDevice
from kaitian.devices.vendors import cambricon, cpu, nvidia
from kaitian.devices.vendors.tools import has_tool, run_tool
from kaitian.errors import UnknownVendorError

__all__ = ["Vendor", "VENDORS", "vendor", "vendor_names", "UnknownVendorError", "has_tool", "run_tool"]

ContainerHook = Callable[[Sequence[WorkerDevice], Optional[Iterable[str]]], ContainerDevices]


@dataclass(frozen=True)
class Vendor:
    """One device type and how to find, watch and drive it.

    Attributes:
        name: device type, as in ``torch.device(name)`` and ``KAITIAN_DEVICE_TYPE``.
        selector_env: the variable that selects devices (``USE_CUDA``).
        intra_backend: torch distributed backend used inside a group of this type.
        visible_env: the vendor's visibility variable, or ``None``.
        module: extra module that must be imported to use the device type.
        image: default container image for ``--runtime docker``.
        count: number of devices of this type torch sees in this process (workers).
        set_device: makes a torch ordinal current for the process.
        probe: this host's devices, physical indices, found without torch
            (``None``: the type has no hardware to find, as the CPU).
        sources: where ``probe`` looks, for error messages.
        utilisation: physical index -> utilisation percent, now.
        container: what a container needs to see exactly some devices.
    """

    name: str
    selector_env: str
    intra_backend: str
    visible_env: Optional[str]
    module: Optional[str]
    image: str
    count: Callable[[], int]
    set_device: Optional[Callable[[int], None]] = None
    aliases: tuple = field(default=())
    probe: Optional[Callable[[], List[Device]]] = None
    sources: str = ""
    utilisation: Optional[Callable[[], Dict[int, float]]] = None
    container: Optional[ContainerHook] = None

    def torch_device(self, index: Optional[int] = None) -> str:
        """The torch device string for a torch ordinal (``cuda:1``, ``cpu``)."""
        if self.name == "cpu" or index is None:
            return self.name
        return f"{self.name}:{index}"

    def import_module(self) -> None:
        """Imports the vendor's torch plug-in (``torch_mlu``) if it needs one."""
        if self.module:
            importlib.import_module(self.module)


VENDORS: Dict[str, Vendor] = {
    v.name: v
    for v in (
        Vendor(
            name="cuda",
            selector_env="USE_CUDA",
            intra_backend="nccl",
            visible_env="CUDA_VISIBLE_DEVICES",
            module=None,
            image="kaitian:cuda",
            count=nvidia.count,
            set_device=nvidia.set_device,
            probe=nvidia.probe,
            sources=nvidia.SOURCES,
            utilisation=nvidia.utilisation,
            container=nvidia.container_devices,
        ),
        Vendor(
            name="mlu",
            selector_env="USE_MLU",
            intra_backend="cncl",
            visible_env="MLU_VISIBLE_DEVICES",
            module="torch_mlu",
            image="kaitian:mlu",
            count=cambricon.count,
            set_device=cambricon.set_device,
            probe=cambricon.probe,
            sources=cambricon.SOURCES,
            utilisation=cambricon.utilisation,
            container=cambricon.container_devices,
        ),
        Vendor(
            name="cpu",
            selector_env="USE_CPU",
            intra_backend="gloo",
            visible_env=None,
            module=None,
            image="kaitian:cpu",
            count=cpu.count,
            sources=cpu.SOURCES,
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
