"""CPU pinning and CPU-time quotas for local workers.

``--cpu-quota`` simulates slower devices on a CPU-only host: each kaitian group
gets a share of CPU time. Two ways to enforce it:

- cgroup v1 cpu controller (preferred): ``/sys/fs/cgroup/cpu/kaitian/<run>/<group>``
  with ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; every process the worker
  starts later is inside it too.
- a SIGSTOP/SIGCONT duty cycle driven by a thread of the agent, when the
  cgroup tree is not writable (no root, cgroup v2 only, containers).
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple
from kaitian.errors import QuotaUnavailableError

__all__ = [
    "CPU_PERIOD_US",
    "MIN_CPU_QUOTA",
    "cfs_limits",
    "pin",
    "CgroupQuota",
    "DutyCycle",
    "QuotaUnavailableError",
    "cgroup_root",
    "cgroups_writable",
    "collect_stale_cgroups",
    "quota_mode",
]

logger = logging.getLogger(__name__)

_CGROUP_CPU = "/sys/fs/cgroup/cpu"
# A short period makes a quota'd worker uniformly slower (like a slower device)
# instead of bursty: with 100 ms, a 30-100 ms training step runs at full speed
# and then freezes, and per-phase timings become meaningless.
CPU_PERIOD_US = 10_000
_MIN_QUOTA_US, _MAX_PERIOD_US = 1_000, 1_000_000  # the kernel's (and the Docker engine's) bounds
MIN_CPU_QUOTA = _MIN_QUOTA_US / _MAX_PERIOD_US  # cores


def cfs_limits(cores: float, period_us: int = CPU_PERIOD_US) -> Tuple[int, int]:
    """``(period, quota)`` in microseconds giving exactly ``cores`` of CPU time: ``period_us``, longer
    only where the quota would fall below the kernel's smallest (1 ms: under 0.1 core in 10 ms)."""
    if not MIN_CPU_QUOTA <= cores:
        raise ValueError(f"a CPU quota of {cores:g} cores is below the smallest, {MIN_CPU_QUOTA:g}")
    period = min(_MAX_PERIOD_US, max(period_us, math.ceil(_MIN_QUOTA_US / cores)))
    return period, max(_MIN_QUOTA_US, round(cores * period))


def pin(pid: int, cpus: Sequence[int]) -> None:
    """Pins a process and every thread it already has to ``cpus``.

    Threads created later inherit the mask, so pinning right after the
    process is started covers the worker and everything it starts.
    """
    if not cpus:
        return
    mask = set(cpus)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:  # the thread exited meanwhile
            pass


def cgroup_root() -> str:
    """``/sys/fs/cgroup/cpu/kaitian``."""
    return os.path.join(_CGROUP_CPU, "kaitian")


def cgroups_writable() -> bool:
    """Whether this process can create cgroups under the cpu controller."""
    if not os.path.isfile(os.path.join(_CGROUP_CPU, "cpu.cfs_quota_us")):
        return False
    try:
        os.makedirs(cgroup_root(), exist_ok=True)
    except OSError:
        return False
    return os.access(cgroup_root(), os.W_OK)


def quota_mode(wanted: str) -> str:
    """Resolves ``KAITIAN_CPU_QUOTA_MODE`` (``auto``, ``cgroup``, ``signal``) to ``cgroup`` or ``signal``.

    Raises:
        QuotaUnavailableError: ``cgroup`` was asked for but cannot be written.
    """
    if wanted == "auto":
        return "cgroup" if cgroups_writable() else "signal"
    if wanted == "cgroup" and not cgroups_writable():
        raise QuotaUnavailableError(
            "KAITIAN_CPU_QUOTA_MODE=cgroup but /sys/fs/cgroup/cpu is not writable; "
            "run as root with cgroup v1 or use KAITIAN_CPU_QUOTA_MODE=signal"
        )
    return wanted


def _write(path: str, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _empty_and_remove(path: str) -> bool:
    """Moves any process left in a cgroup to the root cgroup and removes it."""
    for _ in range(50):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [p for p in f.read().split() if p]
        except OSError:
            pids = []
        for pid in pids:
            try:
                _write(os.path.join(_CGROUP_CPU, "cgroup.procs"), pid)
            except OSError:
                pass
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.02)  # a process is still exiting
    return False


class CgroupQuota:
    """One cgroup per kaitian group of this agent's run.

    Args:
        run: the run's cgroup name (unique per agent; holds the agent pid).
    """

    def __init__(self, run: str) -> None:
        self.path = os.path.join(cgroup_root(), run)
        self._groups: Dict[str, str] = {}

    def set_quota(self, group: str, cores: float) -> None:
        """Creates (or updates) the group's cgroup with ``cores`` of CPU time."""
        path = os.path.join(self.path, re.sub(r"[^A-Za-z0-9_.-]", "_", group))
        os.makedirs(path, exist_ok=True)
        period, quota = cfs_limits(cores)
        _write(os.path.join(path, "cpu.cfs_period_us"), period)
        _write(os.path.join(path, "cpu.cfs_quota_us"), quota)
        self._groups[group] = path

    def add(self, group: str, pid: int) -> None:
        """Moves a process (all its threads) into the group's cgroup."""
        _write(os.path.join(self._groups[group], "cgroup.procs"), pid)

    def remove(self) -> None:
        """Deletes the run's cgroups (idempotent)."""
        for path in self._groups.values():
            _empty_and_remove(path)
        self._groups.clear()
        if os.path.isdir(self.path):
            _empty_and_remove(self.path)


def collect_stale_cgroups() -> List[str]:
    """Removes the cgroups of agents that are gone (``<run>`` names end in ``.<pid>``)."""
    removed: List[str] = []
    root = cgroup_root()
    try:
        runs = os.listdir(root)
    except OSError:
        return removed
    for run in runs:
        path = os.path.join(root, run)
        m = re.search(r"\.(\d+)$", run)
        if not m or not os.path.isdir(path):
            continue
        if os.path.exists(f"/proc/{m.group(1)}"):
            continue
        try:
            groups = os.listdir(path)
        except FileNotFoundError:  # its agent, which exited just now, removed it meanwhile
            continue
        for group in groups:
            if os.path.isdir(os.path.join(path, group)):
                _empty_and_remove(os.path.join(path, group))
        if _empty_and_remove(path):
            removed.append(path)
    return removed


class DutyCycle:
    """Throttles process groups with SIGSTOP/SIGCONT: each runs ``fraction`` of every period.

    Args:
        period: length of one cycle in seconds.
    """

    def __init__(self, period: float = 0.02) -> None:
        self._period = period
        self._targets: Dict[int, float] = {}  # pid (its process group) -> fraction
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def add(self, pids: Iterable[int], fraction: float) -> None:
        """Throttles ``pids`` (and their process groups) to ``fraction`` of the time."""
        if fraction >= 1.0:
            return
        with self._lock:
            for pid in pids:
                self._targets[pid] = max(0.01, fraction)
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="kaitian-cpu-quota", daemon=True)
            self._thread.start()

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pid, sig)
        except OSError:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def _loop(self) -> None:
        # A target's share is of the cycles' real length, and what it ran beyond
        # it (this thread woke up late on a busy machine) is taken back in the
        # next cycles: the fraction holds under load, not only on an idle host.
        owed: Dict[int, float] = {}  # pid -> seconds run beyond its share
        while not self._stop.is_set():
            start = time.monotonic()
            with self._lock:
                targets = dict(self._targets)
            share = {pid: fraction * self._period - owed.get(pid, 0.0) for pid, fraction in targets.items()}
            for pid in targets:
                if share[pid] > 0:
                    self._signal(pid, signal.SIGCONT)
            ran: Dict[int, float] = {}
            for pid in sorted(share, key=share.get):
                delay = start + share[pid] - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    break
                with self._lock:  # never stop a process release() has just let go
                    if pid in self._targets:
                        self._signal(pid, signal.SIGSTOP)
                ran[pid] = time.monotonic() - start if share[pid] > 0 else 0.0
            rest = start + self._period - time.monotonic()
            if rest > 0:
                self._stop.wait(rest)
            cycle = time.monotonic() - start
            # (a long stall while stopped is not made up in one burst: at most one extra share)
            owed = {pid: max(owed.get(pid, 0.0) + ran[pid] - targets[pid] * cycle, -targets[pid] * self._period)
                    for pid in ran}
        with self._lock:
            for pid in self._targets:
                self._signal(pid, signal.SIGCONT)

    def release(self, pids: Optional[Iterable[int]] = None) -> None:
        """Stops throttling ``pids`` (default: all) and lets them run."""
        with self._lock:
            chosen = list(self._targets) if pids is None else [p for p in pids if p in self._targets]
            for pid in chosen:
                self._targets.pop(pid, None)
            empty = not self._targets
        if empty and self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        for pid in chosen:
            self._signal(pid, signal.SIGCONT)
