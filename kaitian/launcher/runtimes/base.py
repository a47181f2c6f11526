"""The contract between the elastic agent and a worker runtime.

The agent decides *what* to run (ranks, complete environments, devices); a runtime
decides *where*: local subprocesses, or ``docker exec`` inside per-vendor
containers. A runtime returns torch's ``PContext`` so the agent monitors,
collects error files and stops workers the same way for every runtime.
"""

from __future__ import annotations

import abc
import os
import signal
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

from kaitian._torch import LogsSpecs, PContext
from kaitian.devices.device import ContainerDevices
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.runtimes.options import RuntimeOptions

__all__ = ["WorkerStart", "RunContext", "Runtime"]


@dataclass(frozen=True)
class WorkerStart:
    """One (re)start of a node's worker group, or of one of its workers: what the agent asks a runtime to run.

    Every mapping is keyed by the process's index in this start, ``0 ..
    n-1`` (torch's process contexts number their processes so): the local
    rank for a whole group's start; ``0`` for one worker started alone
    (``--on-failure continue``), whose :class:`LocalWorker` keeps its local rank.

    Attributes:
        name: the worker group's name (torchelastic role).
        entrypoint: the binary (the host's python, usually) or a function.
        args: worker arguments.
        envs: worker environments.
        logs_specs: where stdout / stderr / error files go.
        workers: the node's worker each process is.
        log_line_prefixes: console prefixes.
        start_method: torch's multiprocessing start method (functions only).
    """

    name: str
    entrypoint: Union[str, Callable]
    args: Dict[int, Tuple]
    envs: Dict[int, Dict[str, str]]
    logs_specs: LogsSpecs
    workers: Dict[int, LocalWorker]
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
        cpu_quotas: group -> the CPU time its workers share, in cores (``NodeWorkers.cpu_quotas``).
    """

    run_id: str
    run_dir: str
    log_dir: Optional[str]
    cwd: str
    options: RuntimeOptions = field(default_factory=RuntimeOptions)
    cpu_quotas: Mapping[str, float] = field(default_factory=dict)


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

    def devices_seen(self, workers: Dict[int, LocalWorker]) -> Dict[int, ContainerDevices]:
        """The devices of the container each of ``workers`` (started together) will run in;
        a worker not named runs on the host. Decides nothing else of its environment."""
        return {}

    def before_stop(self) -> None:
        """Called by the agent right before it stops the workers it started."""

    def exit_codes(self, pcontext: PContext) -> Dict[int, Optional[int]]:
        """Each worker's exit code by key, ``None`` while it runs; stops nobody.

        ``--on-failure continue`` polls workers one by one: torch's
        ``PContext.wait`` stops every worker once one has failed.
        """
        from kaitian._torch import subprocess_exit_codes

        return subprocess_exit_codes(pcontext)

    def forget_worker(self, pid: int) -> None:
        """A worker the agent started alone has exited: drop what tracks its pid (it may be reused)."""

    def kill_worker(self, pcontext: PContext, key: int) -> None:
        """SIGKILLs one worker of ``pcontext`` and what it forked (its process group)."""
        pid = pcontext.pids()[key]
        for send, target in ((os.killpg, pid), (os.kill, pid)):
            try:
                send(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def shutdown(self) -> None:
        """Releases everything the run created (containers, cgroups). Idempotent."""

    @classmethod
    def collect_stale(cls) -> List[str]:
        """Removes what agents that were killed left behind; returns what it removed."""
        return []
