"""PCI sysfs (``/sys/bus/pci/devices``): the fallback that finds accelerators with no vendor tool.

The kernel lists every PCI function with its vendor id, class, NUMA node and
nearby cores. Devices of one vendor sorted by bus id are numbered as the
vendors' tools number them (NVML enumerates in PCI bus order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

__all__ = ["PCI_ROOT", "PciFunction", "pci_functions", "find_function", "normalise_bus_id", "parse_cpulist"]

PCI_ROOT = "/sys/bus/pci/devices"


@dataclass(frozen=True)
class PciFunction:
    """One PCI function of a vendor.

    Attributes:
        bus_id: ``dddd:bb:dd.f``, lower case.
        device_id: the PCI device id (``0x2330``).
        pci_class: the PCI class code (``0x030200``).
        numa_node: the NUMA node it hangs off, or ``None``.
        cpus: the cores local to it (``local_cpulist``).
    """

    bus_id: str
    device_id: str
    pci_class: int
    numa_node: Optional[int]
    cpus: Tuple[int, ...]


def parse_cpulist(text: str) -> List[int]:
    """``0-3,8`` (the kernel's cpulist format) -> core numbers."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return cpus


def normalise_bus_id(raw: str) -> str:
    """A PCI bus id in the kernel's form: ``00000000:3B:00.0`` -> ``0000:3b:00.0``."""
    raw = raw.strip().lower()
    domain, sep, rest = raw.partition(":")
    if not sep or rest.count(":") != 1:
        return raw
    return f"{int(domain, 16):04x}:{rest}"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _function(root: str, entry: str) -> Optional[PciFunction]:
    base = os.path.join(root, entry)
    pci_class = _read(os.path.join(base, "class"))
    if pci_class is None:
        return None
    node = _read(os.path.join(base, "numa_node"))
    cpulist = _read(os.path.join(base, "local_cpulist"))
    try:
        return PciFunction(
            bus_id=normalise_bus_id(entry),
            device_id=(_read(os.path.join(base, "device")) or "").lower(),
            pci_class=int(pci_class, 16),
            numa_node=int(node) if node is not None and int(node) >= 0 else None,
            cpus=tuple(parse_cpulist(cpulist)) if cpulist else (),
        )
    except ValueError:
        return None


def pci_functions(vendor_id: int, classes: Iterable[int], root: str = PCI_ROOT) -> List[PciFunction]:
    """The functions of one vendor whose base class is one of ``classes``, by bus id.

    Args:
        vendor_id: PCI vendor id (``0x10de`` NVIDIA, ``0xcabc`` Cambricon).
        classes: accepted base classes (``0x03`` display, ``0x12`` accelerator);
            a GPU's audio or USB functions are left out this way.
        root: the sysfs directory (a tmp tree in tests).
    """
    wanted = set(classes)
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return []
    found: List[PciFunction] = []
    for entry in entries:
        vendor = _read(os.path.join(root, entry, "vendor"))
        try:
            if vendor is None or int(vendor, 16) != vendor_id:
                continue
        except ValueError:
            continue
        function = _function(root, entry)
        if function is not None and function.pci_class >> 16 in wanted:
            found.append(function)
    return sorted(found, key=lambda f: f.bus_id)


def find_function(bus_id: Optional[str], root: str = PCI_ROOT) -> Optional[PciFunction]:
    """The PCI function at a bus id (any vendor), for its NUMA node and cores."""
    if not bus_id:
        return None
    bus_id = normalise_bus_id(bus_id)
    if not os.path.isdir(os.path.join(root, bus_id)):
        return None
    return _function(root, bus_id)
