"""The contract between the elastic agent and a worker runtime.

The agent decides *what* to run (ranks, environment, devices); a runtime
decides *where*: local subprocesses, or ``docker exec`` inside per-vendor
containers. A runtime returns torch's ``PContext`` so the agent monitors,
collects error files and stops workers the same way for every runtime.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

from kaitian._torch import LogsSpecs, PContext
from kaitian.devices.device import WorkerDevice
from kaitian.launcher.runtimes.options import RuntimeOptions

__all__ = ["WorkerLaunch", "WorkerStart", "RunContext", "Runtime"]


@dataclass(frozen=True)
class WorkerLaunch:
    """Where and on what one local worker runs.

    Attributes:
        local_rank: rank on this node.
        global_rank: rank in the world.
        device: the worker's device (physical index; CPU: the slot index) and
            kaitian group (``KAITIAN_GROUP``); one container per group.
        cpus: cores the worker is pinned to (empty: no pinning).
        cpu_quota: CPU time the worker's group may use, in cores (``None``: no
            limit). Used to simulate slower devices on a CPU-only host.
    """

    local_rank: int
    global_rank: int
    device: WorkerDevice
    cpus: Tuple[int, ...] = ()
    cpu_quota: Optional[float] = None


@dataclass(frozen=True)
class WorkerStart:
    """One (re)start of a node's worker group: what the agent asks a runtime to run.

    Attributes:
        name: the worker group's name (torchelastic role).
        entrypoint: the binary (the host's python, usually) or a function.
        args: worker arguments by local rank.
        envs: worker environments by local rank.
        logs_specs: where stdout / stderr / error files go.
        workers: what each local rank runs on, by local rank.
        log_line_prefixes: console prefixes by local rank.
        start_method: torch's multiprocessing start method (functions only).
    """

    name: str
    entrypoint: Union[str, Callable]
    args: Dict[int, Tuple]
    envs: Dict[int, Dict[str, str]]
    logs_specs: LogsSpecs
    workers: Dict[int, WorkerLaunch]
    log_line_prefixes: Optional[Dict[int, str]] = None
    start_method: str = "spawn"


@dataclass(frozen=True)
class RunContext:
    """What a runtime needs to know about the whole run on this node.

    Attributes:
        run_id: the rendezvous run id (labels containers, names cgroups).
        run_dir: this node's run directory (``KAITIAN_RUN_DIR``), owner-only.
        log_dir: torchrun's ``--log-dir`` base, or ``None``.
        cwd: the user's working directory.
        options: the runtime options, checked once from the command line.
    """

    run_id: str
    run_dir: str
    log_dir: Optional[str]
    cwd: str
    options: RuntimeOptions = field(default_factory=RuntimeOptions)


class Runtime(abc.ABC):
    """Starts the workers of one node; owns whatever they run inside."""

    name: str = ""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    @abc.abstractmethod
    def start(self, job: WorkerStart) -> PContext:
        """Starts one worker per local rank of ``job`` and returns their ``PContext``.

        Called once per (re)start of the worker group; keyed by local rank.
        """

    def before_stop(self) -> None:
        """Called by the agent right before it stops the workers it started."""

    def shutdown(self) -> None:
        """Releases everything the run created (containers, cgroups). Idempotent."""

    @classmethod
    def collect_stale(cls) -> List[str]:
        """Removes what agents that were killed left behind; returns what it removed."""
        return []
