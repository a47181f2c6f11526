"""What this node runs: its workers, decided once before the agent starts.

``--nproc-auto``: one worker per selected device (``USE_<VENDOR>`` /
``--devices``), CPU workers pinned to their slot's cores. ``--nproc-per-node
N`` keeps torchrun's meaning (N workers, no pinning); worker ``i`` gets the
``i``-th selected accelerator, or is a CPU worker when there is none.
``--cpu-groups`` splits the CPU workers into simulated vendor groups
``cpu0``, ``cpu1``, … and ``--cpu-quota`` gives each group its CPU time.
``--numa-binding`` pins each accelerator's worker to host cores near its
device (:mod:`kaitian.devices.numa`).

A worker is one :class:`LocalWorker` from here to the runtime (its device
also travels through the rendezvous and, in the worker's environment, to the
backend); what holds for a whole group or the node (CPU quotas, which devices
the workers see) is on the :class:`NodeWorkers`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from kaitian.devices.device import Device, WorkerDevice
from kaitian.devices.inventory import discover, parse_devices_flag, select
from kaitian.devices.numa import numa_binding as bind_near
from kaitian.errors import NodeWorkersError

__all__ = ["LocalWorker", "NodeWorkers", "NodeWorkersError", "parse_cpu_quota", "node_workers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalWorker:
    """One worker of this node.

    Attributes:
        local_rank: its rank on this node.
        device: its device (physical index; CPU: slot index) and kaitian
            group (``cpu0`` … for simulated groups, else the device type).
        cpus: cores it is pinned to (empty: not pinned). A CPU worker's are
            its compute, and it runs as many OpenMP threads; an accelerator's
            (``--numa-binding``) are near its device, and it keeps torchrun's
            ``OMP_NUM_THREADS``.
    """

    local_rank: int
    device: WorkerDevice
    cpus: Tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeWorkers:
    """This node's workers, and what holds for their groups and for the node.

    Attributes:
        workers: one per local rank, in local-rank order.
        cpu_quotas: group -> the CPU time its workers share, in cores
            (``--cpu-quota``; a group not named has no limit).
        hide_other_vendors: every worker sees no device of another vendor
            (``--nproc-auto``).
        own_device_only: a CUDA worker sees only its own GPU (torchrun's
            ``--virtual-local-rank``).
    """

    workers: Tuple[LocalWorker, ...]
    cpu_quotas: Mapping[str, float] = field(default_factory=dict)
    hide_other_vendors: bool = False
    own_device_only: bool = False


def parse_cpu_quota(raw: Optional[str]) -> Optional[List[float]]:
    """``--cpu-quota 0.5,1.5`` -> ``[0.5, 1.5]``.

    Raises:
        NodeWorkersError: not a comma list of positive numbers.
    """
    if raw is None:
        return None
    try:
        values = [float(x) for x in raw.split(",")]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise NodeWorkersError(f"--cpu-quota {raw!r}: give cores of CPU time per CPU group, e.g. 0.5,1.5")
    from kaitian.launcher.runtimes.cpu_limits import MIN_CPU_QUOTA  # (the runtimes package imports this module)

    if min(values) < MIN_CPU_QUOTA:
        raise NodeWorkersError(f"--cpu-quota {raw!r}: the smallest quota is {MIN_CPU_QUOTA:g} cores")
    return values


def _cpu_groups(count: int, groups: Optional[int]) -> List[str]:
    """The group of each of ``count`` CPU workers: ``groups`` contiguous blocks, or all ``cpu``."""
    if groups is None:
        return ["cpu"] * count
    if groups < 1:
        raise NodeWorkersError(f"--cpu-groups {groups}: must be at least 1")
    if groups > count:
        raise NodeWorkersError(
            f"--cpu-groups {groups}: only {count} CPU worker(s) on this node; "
            f"add CPU slots (--cpu-slots) or use fewer groups"
        )
    return [f"cpu{j * groups // count}" for j in range(count)]


def node_workers(
    *,
    nproc_auto: bool,
    nproc_per_node: Optional[int],
    devices_flag: Optional[str] = None,
    cpu_slots: Optional[int] = None,
    cpu_groups: Optional[int] = None,
    cpu_quota: Optional[Sequence[float]] = None,
    own_device_only: bool = False,
    numa_binding: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    devices: Optional[List[Device]] = None,
) -> NodeWorkers:
    """Decides this node's workers.

    Args:
        nproc_auto: one worker per selected device.
        nproc_per_node: torchrun's worker count (used when not ``nproc_auto``).
        devices_flag: ``--devices``.
        cpu_slots: ``--cpu-slots``.
        cpu_groups: ``--cpu-groups``.
        cpu_quota: ``--cpu-quota`` values (one, or one per CPU group).
        own_device_only: ``--virtual-local-rank``.
        numa_binding: torchrun's ``--numa-binding`` mode, or ``None``.
        env: environment holding ``USE_<VENDOR>`` and the host's visibility
            variables (default ``os.environ``).
        devices: the inventory (default: discovered, physical indices).

    Raises:
        DeviceSelectionError: bad ``USE_*`` / ``--devices`` / ``--cpu-slots``.
        NodeWorkersError: inconsistent kaitian flags.
    """
    if devices is None:
        devices = discover(cpu_slots, env=env)
    flag = parse_devices_flag(devices_flag) if devices_flag else None
    selected = select(devices, env=env, flag=flag)
    accels = [d for d in selected if d.type != "cpu"]

    if nproc_auto:
        chosen: List[Device] = list(selected)
    else:
        n = int(nproc_per_node or 1)
        if accels:
            chosen = [accels[i % len(accels)] for i in range(n)]
        else:
            chosen = [Device("cpu", i, "CPU") for i in range(n)]

    cpu_positions = [i for i, c in enumerate(chosen) if c.type == "cpu"]
    if cpu_groups is not None and not cpu_positions:
        raise NodeWorkersError(f"--cpu-groups {cpu_groups}: no CPU worker selected on this node (set USE_CPU)")
    group_of: Dict[int, str] = dict(zip(cpu_positions, _cpu_groups(len(cpu_positions), cpu_groups)))
    n_groups = cpu_groups or 1
    if cpu_quota is not None and len(cpu_quota) not in (1, n_groups):
        raise NodeWorkersError(
            f"--cpu-quota has {len(cpu_quota)} values for {n_groups} CPU group(s); give 1 or {n_groups}"
        )
    groups = dict.fromkeys(group_of.values())  # in order: cpu0, cpu1, … (or cpu)
    quotas = {g: cpu_quota[j if len(cpu_quota) > 1 else 0] for j, g in enumerate(groups)} if cpu_quota else {}

    cpus = [tuple(dev.cpus) if nproc_auto and dev.type == "cpu" else () for dev in chosen]
    if numa_binding:
        if not nproc_auto and cpu_positions:
            raise NodeWorkersError(
                f"--numa-binding {numa_binding}: CPU workers are bound as CPU slots, one per NUMA node: "
                "use --nproc-auto (USE_CPU, --cpu-slots)"
            )
        accel_positions = [i for i, dev in enumerate(chosen) if dev.type != "cpu"]
        for i, near in zip(accel_positions, bind_near([chosen[i] for i in accel_positions], numa_binding)):
            cpus[i] = near
    workers = tuple(
        LocalWorker(local_rank=i, device=dev.worker_device(group_of.get(i)), cpus=cpus[i])
        for i, dev in enumerate(chosen)
    )
    return NodeWorkers(workers, quotas, hide_other_vendors=nproc_auto, own_device_only=own_device_only)
