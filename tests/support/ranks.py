"""Starts the ranks of one simulated heterogeneous layout as processes.

The ranks are forks of an interpreter that has imported torch (support/zygote.py:
a rank costs 30 ms instead of the 1.2 s of CPU a fresh ``import torch`` takes
here; ``KT_FRESH_RANKS=1`` starts fresh interpreters instead).

Shared by the collective-matrix and DDP tests: a *layout* such as ``"2+1"``
means two ranks in group ``cpu0`` and one in ``cpu1``; every rank gets the
environment ``kaitianrun --cpu-groups`` would give it (``KAITIAN_GROUP``,
``KAITIAN_DEVICE_TYPE``, ``KAITIAN_RUN_DIR``) plus any extra variables. A
group may be of fake MLUs instead (``devices``): its ranks get ``mlu:0``,
``mlu:1``, … of the fake accelerator (``KAITIAN_FAKE_ACCELERATOR``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = ["Layout", "RankRun", "run_ranks", "kill_ranks", "free_port", "shm_segments"]

from kaitian.devices.device import WorkerDevice
from kaitian.settings import Settings
from support import REPO, TESTS
from support.zygote import start_rank


@dataclass(frozen=True)
class Layout:
    """Ranks per simulated vendor group, plus transport settings.

    Attributes:
        spec: ``"2+1"`` style: number of ranks in each group, in rank order.
        env: extra environment for every rank (``KAITIAN_BRIDGE`` …).
        kaitian_env: give ranks the ``KAITIAN_*`` variables kaitianrun sets;
            ``False`` is the plain-torchrun case (group = device type).
        core_only: run only the reduced matrix (transport variants).
        devices: device type of each group, ``cpu`` (default) or ``mlu``: a
            group of fake MLUs, one per rank (named ``mlu``; the CPU groups
            keep ``cpu0``, ``cpu1``, … in order).
    """

    spec: str
    env: tuple = ()
    kaitian_env: bool = True
    core_only: bool = False
    devices: tuple = ()

    def _group_specs(self) -> List[tuple]:
        """(ranks, device type) of each group."""
        sizes = [int(n) for n in self.spec.split("+")]
        return list(zip(sizes, self.devices or ("cpu",) * len(sizes)))

    @property
    def groups(self) -> List[str]:
        out: List[str] = []
        cpu_groups = 0
        for n, dev in self._group_specs():
            if dev == "cpu":
                out += [f"cpu{cpu_groups}" if self.kaitian_env else "cpu"] * n
                cpu_groups += 1
            else:
                out += [dev] * n
        return out

    @property
    def rank_devices(self) -> List[tuple]:
        """(device type, index) of every rank: CPU ranks are slot ``rank``, MLUs count from 0."""
        out: List[tuple] = []
        mlus = 0
        for n, dev in self._group_specs():
            for _ in range(n):
                out.append(("cpu", len(out)) if dev == "cpu" else (dev, mlus))
                mlus += dev != "cpu"
        return out

    @property
    def fake_mlus(self) -> int:
        """Ranks on fake MLUs (each rank's process installs that many)."""
        return sum(1 for kind, _ in self.rank_devices if kind == "mlu")

    @property
    def world_size(self) -> int:
        return len(self.groups)

    @property
    def id(self) -> str:
        parts = [f"{k.replace('KAITIAN_', '').lower()}={v}" for k, v in self.env]
        if not self.kaitian_env:
            parts.append("torchrun-env")
        spec = "+".join(f"{n}{dev}" for n, dev in self._group_specs()) if self.devices else self.spec
        return spec + (f"[{','.join(parts)}]" if parts else "")


@dataclass
class RankRun:
    """What the ranks of one run left behind."""

    returncodes: List[Optional[int]]
    logs: List[str]
    outs: List[str]
    timed_out: bool
    seconds: float
    workdir: str = ""
    leftover_shm: List[str] = field(default_factory=list)
    pids: List[int] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_segments(pids: Optional[Sequence[int]] = None) -> set:
    """Names in /dev/shm that look like kaitian's; with ``pids``, only the segments
    those processes created (a kaitian segment's name carries its creator's pid),
    so that other jobs on the machine do not count."""
    try:
        names = {n for n in os.listdir("/dev/shm") if "kaitian" in n.lower() or n.startswith("kt")}
    except FileNotFoundError:
        return set()
    if pids is None:
        return names
    wanted = {str(p) for p in pids}
    return {n for n in names if n.startswith("kaitian-") and n.split("-")[2:3] and n.split("-")[2] in wanted}


def run_ranks(layout: Layout, argv: Sequence[str], timeout: float, workdir: Optional[str] = None) -> RankRun:
    """Runs ``python argv... --rank R --world-size W --groups ... --init-method ... --out F`` per rank.

    Args:
        layout: the layout to start.
        argv: script and arguments common to every rank.
        timeout: seconds before every rank is killed.
        workdir: where outputs and the run directory go (a fresh temp dir by default).

    Returns:
        The per-rank return codes, logs and output files.
    """
    workdir = workdir or tempfile.mkdtemp(prefix="kt-test-")
    run_dir = os.path.join(workdir, "run")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    before = shm_segments()
    port = free_port()
    groups = layout.groups
    procs, logs, outs = [], [], []
    start = time.monotonic()
    for rank, group in enumerate(groups):
        log = os.path.join(workdir, f"rank{rank}.log")
        out = os.path.join(workdir, f"rank{rank}.jsonl")
        env = dict(os.environ)
        for key in [k for k in env if k.startswith("KAITIAN_")]:
            del env[key]
        env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [REPO, TESTS, env.get("PYTHONPATH")])),
                    "KT_MATRIX_MARKERS": os.path.join(workdir, "markers"), "PYTHONUNBUFFERED": "1"})
        fake = ("mlu", layout.fake_mlus) if layout.fake_mlus else None
        if layout.kaitian_env:  # what kaitianrun gives the rank
            kaitian = Settings.for_device(WorkerDevice(*layout.rank_devices[rank], group), run_dir=run_dir,
                                          fake_accelerator=fake)
        else:
            kaitian = Settings(fake_accelerator=fake)
        env.update(kaitian.to_env())
        # torchrun's worker environment (the workers' convention: support/worker_env.py)
        env.update({"RANK": str(rank), "WORLD_SIZE": str(len(groups)), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(len(groups)), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "KT_OUT": out, "KT_GROUPS": ",".join(groups)})
        env.update(dict(layout.env))
        procs.append(start_rank(argv, env, REPO, log))
        logs.append(log)
        outs.append(out)
    timed_out = False
    deadline = start + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p in procs:
            if p.poll() is None:
                # dump Python stacks first (faulthandler is enabled in the ranks)
                try:
                    os.killpg(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(1.0)
        kill_ranks(procs)
    time.sleep(0.2)
    pids = [p.pid for p in procs]
    leftover = sorted(shm_segments(pids) - before)
    return RankRun([p.returncode for p in procs], logs, outs, timed_out, time.monotonic() - start, workdir,
                   leftover, pids)


def kill_ranks(procs) -> None:
    """Kills the sessions of the ranks still running and waits for them."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
            p.wait()


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def cleanup(run: RankRun) -> None:
    shutil.rmtree(run.workdir, ignore_errors=True)
