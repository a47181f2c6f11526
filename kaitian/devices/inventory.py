"""This host's device inventory: every vendor's probe, the host's visibility variables, ``kaitian devices``' table.

Discovery never needs torch: each vendor's probe (:mod:`kaitian.devices.vendors`)
reads its management library, tool, device nodes or PCI sysfs. Devices keep
their physical indices; a host ``CUDA_VISIBLE_DEVICES`` / ``MLU_VISIBLE_DEVICES``
(indices or UUIDs) leaves only the devices it lists. CPU "devices" are slots
of this host's cores, one per NUMA node by default.
"""

from __future__ import annotations

import os
from typing import List, Mapping, Optional, Sequence

from kaitian.devices.device import Device
from kaitian.devices.select import DeviceSelectionError, parse_devices_flag, select
from kaitian.devices.vendors import vendor, vendor_names
from kaitian.devices.vendors.cpu import cpu_slots, format_cpulist, numa_nodes
from kaitian.devices.visible import visible_devices

__all__ = [
    "format_cpulist",
    "Device",
    "DeviceSelectionError",
    "discover",
    "cpu_slots",
    "numa_nodes",
    "select",
    "parse_devices_flag",
    "format_table",
]

def discover(slots: Optional[int] = None, env: Optional[Mapping[str, str]] = None) -> List[Device]:
    """Every device on this host, accelerators first, CPU slots last.

    Args:
        slots: number of CPU slots (default: one per NUMA node).
        env: environment holding the visibility variables (default ``os.environ``).

    Returns:
        The devices in layout order (vendor table order, then physical index).

    Raises:
        DeviceSelectionError: ``cpu_slots`` is out of range.
    """
    env = os.environ if env is None else env
    found: List[Device] = []
    for name in vendor_names():
        v = vendor(name)
        if name == "cpu":
            found.extend(cpu_slots(slots))
        elif v.probe is not None:
            try:
                devices = v.probe()
            except Exception:  # a broken driver must not stop a CPU job
                devices = []
            found.extend(visible_devices(devices, env.get(v.visible_env) if v.visible_env else None))
    return found


def _human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def format_table(devices: Sequence[Device]) -> str:
    """The inventory as an aligned text table."""
    head = ("KEY", "VENDOR", "INDEX", "NAME", "MEMORY", "BUS ID", "UUID", "LINK", "CPUS", "CAPABILITY")
    rows = [head]
    for d in devices:
        rows.append(
            (
                d.key,
                d.type,
                str(d.index),
                d.name,
                _human_bytes(d.memory_bytes),
                d.bus_id or "-",
                d.uuid or "-",
                d.link or "-",
                format_cpulist(d.cpus) if d.cpus else "-",
                f"{d.capability:.1f}/s" if d.capability is not None else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
