"""torchrun's ``--numa-binding`` for every vendor: the host cores each worker is bound to.

torch binds the worker of local rank i to the NUMA node of CUDA device i. A kaitian node's local ranks
are not CUDA indices (it mixes vendors, and ``USE_CUDA`` picks a subset), so kaitian decides the cores
itself: from each device's near cores (sysfs ``local_cpulist``, its NUMA node's) and the CPU topology
in ``/sys/devices/system/cpu``, with torch's four modes (``torch.numa.binding.AffinityMode``).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

from kaitian.devices.device import Device
from kaitian.devices.vendors.pci import parse_cpulist
from kaitian.errors import NodeWorkersError

__all__ = ["MODES", "CPU_ROOT", "numa_binding"]

MODES = ("node", "socket", "exclusive", "core-complex")
CPU_ROOT = "/sys/devices/system/cpu"


def _read(cpu_root: str, cpu: int, rel: str) -> Optional[str]:
    try:
        with open(os.path.join(cpu_root, f"cpu{cpu}", rel)) as f:
            return f.read().strip()
    except OSError:
        return None


def _groups(cores: Sequence[int], cpu_root: str, rel: str) -> List[Tuple[int, ...]]:
    """``cores`` grouped by the cpulist at ``rel`` (a core without one is a group alone), by first core."""
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for c in cores:
        text = _read(cpu_root, c, rel)
        key = tuple(parse_cpulist(text)) if text else (c,)
        groups.setdefault(key, []).append(c)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


def _split(units: List[Tuple[int, ...]], parts: int, part: int) -> Tuple[int, ...]:
    """Part ``part`` of ``units`` cut into ``parts`` contiguous, near-equal runs."""
    lo, hi = part * len(units) // parts, (part + 1) * len(units) // parts
    return tuple(c for unit in units[lo:hi] for c in unit)


def numa_binding(devices: Sequence[Device], mode: str, allowed: Optional[Sequence[int]] = None,
                 cpu_root: str = CPU_ROOT) -> List[Tuple[int, ...]]:
    """The cores each worker's device binds it to under ``mode``, one entry per device given (in order;
    a device given twice has two workers).

    - ``node``: the cores near the device (its NUMA node's);
    - ``socket``: every core of the sockets those cores are on;
    - ``exclusive``: the node's physical cores (hyperthreads together) split among the workers whose
      devices share the node, in order, so that no two share a core;
    - ``core-complex``: one L3 group of the node's cores, a different one per worker where there are enough.

    Args:
        allowed: the cores this process may use (default: its affinity); nothing outside it is chosen.

    Raises:
        NodeWorkersError: a device's near cores are unknown, or a node has more workers than cores.
    """
    if mode not in MODES:
        raise NodeWorkersError(f"--numa-binding {mode}: unknown; choose one of {', '.join(MODES)}")
    allowed_set = set(os.sched_getaffinity(0) if allowed is None else allowed)
    near = []
    for d in devices:
        cores = tuple(sorted(set(d.cpus) & allowed_set))
        if not cores:
            raise NodeWorkersError(
                f"--numa-binding {mode}: the host cores near {d.key} are unknown (no NUMA node in sysfs, "
                "or none this process may use); leave --numa-binding out"
            )
        near.append(cores)
    peers = {cores: [i for i, other in enumerate(near) if other == cores] for cores in set(near)}
    if mode == "socket":
        package = {c: _read(cpu_root, c, "topology/physical_package_id") for c in sorted(allowed_set)}
    bound = []
    for i, cores in enumerate(near):
        if mode == "node":
            bound.append(cores)
            continue
        if mode == "socket":
            packages = {package[c] for c in cores}
            bound.append(tuple(c for c in package if package[c] in packages))
            continue
        share = peers[cores]
        if mode == "exclusive":
            physical = _groups(cores, cpu_root, "topology/thread_siblings_list")
            if len(physical) < len(share):
                raise NodeWorkersError(
                    f"--numa-binding exclusive: {len(share)} workers share the {len(physical)} physical "
                    f"cores near {devices[i].key}; use --numa-binding node"
                )
            bound.append(_split(physical, len(share), share.index(i)))
        else:  # core-complex
            complexes = _groups(cores, cpu_root, "cache/index3/shared_cpu_list")
            bound.append(complexes[share.index(i) % len(complexes)])
    return bound
