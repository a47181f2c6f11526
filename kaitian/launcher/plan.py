"""What each local worker runs on: the node's plan, decided once before the agent starts.

``--nproc-auto``: one worker per selected device (``USE_<VENDOR>`` /
``--devices``), CPU workers pinned to their slot's cores. ``--nproc-per-node
N`` keeps torchrun's meaning (N workers, no pinning); worker ``i`` gets the
``i``-th selected accelerator, or is a CPU worker when there is none.
``--cpu-groups`` splits the CPU workers into simulated vendor groups
``cpu0``, ``cpu1``, … and ``--cpu-quota`` gives each group its CPU time.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from kaitian.devices.device import Device, WorkerDevice
from kaitian.devices.inventory import discover, parse_devices_flag, select
from kaitian.errors import PlanError

__all__ = ["WorkerPlan", "PlanError", "parse_cpu_quota", "plan_workers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    """One local worker's device and limits.

    Attributes:
        device: its device (physical index; CPU: slot index) and kaitian
            group (``cpu0`` … for simulated groups, else the device type).
        cpus: cores to pin the worker to (empty: not pinned).
        cpu_quota: the group's CPU time in cores, or ``None``.
        omp_threads: ``OMP_NUM_THREADS`` for the worker (``None``: torchrun's rule).
        hide_other_vendors: set other vendors' visibility variables empty.
    """

    device: WorkerDevice
    cpus: Tuple[int, ...] = ()
    cpu_quota: Optional[float] = None
    omp_threads: Optional[int] = None
    hide_other_vendors: bool = False

    @property
    def key(self) -> str:
        """The device's key for capability lookup (``cuda:0``)."""
        return self.device.key


def parse_cpu_quota(raw: Optional[str]) -> Optional[List[float]]:
    """``--cpu-quota 0.5,1.5`` -> ``[0.5, 1.5]``.

    Raises:
        PlanError: not a comma list of positive numbers.
    """
    if raw is None:
        return None
    try:
        values = [float(x) for x in raw.split(",")]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise PlanError(f"--cpu-quota {raw!r}: give cores of CPU time per CPU group, e.g. 0.5,1.5")
    return values


def _groups_for(count: int, groups: Optional[int]) -> List[Optional[str]]:
    if groups is None:
        return [None] * count
    if groups < 1:
        raise PlanError(f"--cpu-groups {groups}: must be at least 1")
    if groups > count:
        raise PlanError(
            f"--cpu-groups {groups}: only {count} CPU worker(s) on this node; "
            f"add CPU slots (--cpu-slots) or use fewer groups"
        )
    return [f"cpu{j * groups // count}" for j in range(count)]


def plan_workers(
    *,
    nproc_auto: bool,
    nproc_per_node: Optional[int],
    devices_flag: Optional[str] = None,
    cpu_slots: Optional[int] = None,
    cpu_groups: Optional[int] = None,
    cpu_quota: Optional[Sequence[float]] = None,
    env: Optional[Mapping[str, str]] = None,
    devices: Optional[List[Device]] = None,
) -> List[WorkerPlan]:
    """Builds this node's worker plan.

    Args:
        nproc_auto: one worker per selected device.
        nproc_per_node: torchrun's worker count (used when not ``nproc_auto``).
        devices_flag: ``--devices``.
        cpu_slots: ``--cpu-slots``.
        cpu_groups: ``--cpu-groups``.
        cpu_quota: ``--cpu-quota`` values (one, or one per CPU group).
        env: environment holding ``USE_<VENDOR>`` and the host's visibility
            variables (default ``os.environ``).
        devices: the inventory (default: discovered, physical indices).

    Returns:
        One plan per local rank.

    Raises:
        DeviceSelectionError: bad ``USE_*`` / ``--devices`` / ``--cpu-slots``.
        PlanError: inconsistent kaitian flags.
    """
    if devices is None:
        devices = discover(cpu_slots, env=env)
    flag = parse_devices_flag(devices_flag) if devices_flag else None
    selected = select(devices, env=env, flag=flag)
    accels = [d for d in selected if d.type != "cpu"]

    if nproc_auto:
        chosen: List[Device] = list(selected)
        pinned = True
    else:
        n = int(nproc_per_node or 1)
        if accels:
            chosen = [accels[i % len(accels)] for i in range(n)]
        else:
            chosen = [Device("cpu", i, "CPU") for i in range(n)]
        pinned = False

    cpu_positions = [i for i, c in enumerate(chosen) if c.type == "cpu"]
    if cpu_groups is not None and not cpu_positions:
        raise PlanError(f"--cpu-groups {cpu_groups}: no CPU worker selected on this node (set USE_CPU)")
    group_names = _groups_for(len(cpu_positions), cpu_groups)
    n_groups = cpu_groups or 1
    if cpu_quota is not None and len(cpu_quota) not in (1, n_groups):
        raise PlanError(
            f"--cpu-quota has {len(cpu_quota)} values for {n_groups} CPU group(s); give 1 or {n_groups}"
        )
    group_of: Dict[int, Optional[str]] = dict(zip(cpu_positions, group_names))

    plans: List[WorkerPlan] = []
    for i, dev in enumerate(chosen):
        group = group_of.get(i)
        quota = None
        is_cpu = dev.type == "cpu"
        if is_cpu and cpu_quota is not None:
            g = int(re.sub(r"\D", "", group) or 0) if group else 0
            quota = cpu_quota[g] if len(cpu_quota) > 1 else cpu_quota[0]
        plans.append(
            WorkerPlan(
                device=dev.worker_device(group),
                cpus=tuple(dev.cpus) if pinned and is_cpu else (),
                cpu_quota=quota,
                omp_threads=len(dev.cpus) if pinned and is_cpu and dev.cpus else None,
                hide_other_vendors=nproc_auto,
            )
        )
    return plans
