"""CPU "devices": slots of this host's cores, one per NUMA node by default."""

from __future__ import annotations

import os
import re
from typing import Dict, Iterable, List, Optional, Sequence

from kaitian.devices.device import Device
from kaitian.devices.vendors.pci import parse_cpulist
from kaitian.errors import DeviceSelectionError

__all__ = ["SOURCES", "cpu_slots", "numa_nodes", "format_cpulist", "count"]

SOURCES = "/sys/devices/system/node"


def numa_nodes(sys_root: str = "/sys/devices/system/node") -> Dict[int, List[int]]:
    """NUMA node -> the cores of this process's affinity mask on it.

    Falls back to a single node 0 with every allowed core when ``/sys`` has no
    NUMA information (containers, non-Linux).
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1)
    )
    nodes: Dict[int, List[int]] = {}
    try:
        for entry in sorted(os.listdir(sys_root)):
            m = re.fullmatch(r"node(\d+)", entry)
            if not m:
                continue
            with open(os.path.join(sys_root, entry, "cpulist")) as f:
                cores = [c for c in parse_cpulist(f.read()) if c in allowed]
            if cores:
                nodes[int(m.group(1))] = cores
    except OSError:
        nodes = {}
    if not nodes or sum(len(c) for c in nodes.values()) < len(allowed):
        return {0: allowed}
    return nodes


def cpu_slots(count: Optional[int] = None) -> List[Device]:
    """This host's cores split into ``count`` slots (default: one per NUMA node).

    With an explicit count, cores are taken in NUMA order and split into
    contiguous, near-equal chunks, so a slot stays inside a node where it can.

    Raises:
        DeviceSelectionError: ``count`` is below 1 or above the number of cores.
    """
    nodes = numa_nodes()
    cores = [c for node in sorted(nodes) for c in nodes[node]]
    node_of = {c: node for node, cs in nodes.items() for c in cs}
    if count is None:
        chunks = [tuple(nodes[n]) for n in sorted(nodes)]
    else:
        if count < 1 or count > len(cores):
            raise DeviceSelectionError(
                f"--cpu-slots {count}: this host has {len(cores)} usable cores; "
                f"choose 1..{len(cores)}"
            )
        chunks = [
            tuple(cores[i * len(cores) // count:(i + 1) * len(cores) // count]) for i in range(count)
        ]
    model = _cpu_model()
    node_memory = _numa_memory(sorted(nodes))
    slots_on_node: Dict[int, int] = {}
    for chunk in chunks:
        for n in {node_of[c] for c in chunk}:
            slots_on_node[n] = slots_on_node.get(n, 0) + 1
    slots = []
    for i, chunk in enumerate(chunks):
        numas = sorted({node_of[c] for c in chunk})
        # a slot's share of its NUMA nodes' memory (an even split between slots)
        memory = sum(node_memory[n] // slots_on_node[n] for n in numas if node_memory.get(n))
        slots.append(
            Device(
                type="cpu",
                index=i,
                name=f"{model}, {len(chunk)} core{'' if len(chunk) == 1 else 's'}",
                memory_bytes=memory or None,
                bus_id=",".join(f"numa{n}" for n in numas),
                link=None,
                cpus=chunk,
            )
        )
    return slots


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def _numa_memory(nodes: Sequence[int], sys_root: str = "/sys/devices/system/node") -> Dict[int, int]:
    """NUMA node -> its memory in bytes (``/sys``; psutil's total for a host without NUMA info)."""
    found: Dict[int, int] = {}
    for n in nodes:
        try:
            with open(os.path.join(sys_root, f"node{n}", "meminfo")) as f:
                m = re.search(r"MemTotal:\s+(\d+)\s*kB", f.read())
            if m:
                found[n] = int(m.group(1)) * 1024
        except OSError:
            pass
    if not found and len(nodes) == 1:
        import psutil

        found[nodes[0]] = int(psutil.virtual_memory().total)
    return found


def format_cpulist(cpus: Iterable[int]) -> str:
    """``0-3,8`` from core numbers (the kernel's cpulist format)."""
    parts: List[str] = []
    start = prev = None
    for c in sorted(set(cpus)):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)


def count() -> int:
    # CPU "devices" are slots of cores; the launcher decides how many. A plain
    # process always has one.
    return 1
