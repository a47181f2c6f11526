"""The default runtime: workers are subprocesses of the agent on this host.

Processes are started by torch's own ``start_processes`` (so logs, error
files and signals behave exactly as under torchrun); on top of that each
worker is pinned to its slot's cores and
put under its group's CPU quota.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from typing import Dict, List, Optional

from kaitian import _torch as _te
from kaitian.launcher.runtimes import die_with_agent
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.runtimes.base import RunContext, Runtime, WorkerStart
from kaitian.launcher.runtimes.cpu_limits import (
    CgroupQuota,
    DutyCycle,
    collect_stale_cgroups,
    pin,
    quota_mode,
)
from kaitian.settings import settings

__all__ = ["LocalRuntime"]

logger = logging.getLogger(__name__)


class LocalRuntime(Runtime):
    """Runs workers as local subprocesses (pinned, optionally CPU-quota'd).

    Reads the ``--duplicate-std*-filters`` of ``ctx.options``; torchrun's ``--numa-binding`` is each
    worker's ``cpus`` (:mod:`kaitian.devices.numa`), pinned as a CPU worker's are.
    """

    name = "local"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self._cgroups: Optional[CgroupQuota] = None
        self._duty: Optional[DutyCycle] = None
        self._mode: Optional[str] = None

    def _quota_mode(self) -> str:
        if self._mode is None:
            self._mode = quota_mode(settings().cpu_quota_mode)
        return self._mode

    def start(self, job: WorkerStart) -> "_te.PContext":
        opts = self.ctx.options
        entrypoint, args = job.entrypoint, job.args
        if isinstance(entrypoint, str):  # a program: it dies with this agent
            program = shutil.which(entrypoint) or entrypoint
            entrypoint = sys.executable
            # Run by path, isolated and without site: the wrapper needs only the
            # standard library, so it adds no torch import to a worker's start.
            args = {r: ("-I", "-S", die_with_agent.__file__, str(os.getpid()), program, *a)
                    for r, a in args.items()}
        pcontext = _te.call_supported(
            _te.start_processes,
            name=job.name,
            entrypoint=entrypoint,
            args=args,
            envs=job.envs,
            logs_specs=job.logs_specs,
            log_line_prefixes=job.log_line_prefixes,
            start_method=job.start_method,
            duplicate_stdout_filters=opts.duplicate_stdout_filters,
            duplicate_stderr_filters=opts.duplicate_stderr_filters,
        )
        try:
            pids = pcontext.pids()
            for key, worker in job.workers.items():
                pin(pids[key], worker.cpus)
            self._apply_quotas(pids, job.workers)
        except BaseException:  # (a Ctrl-C too) the agent never sees this context: close it here
            pcontext.close()
            raise
        return pcontext

    def _apply_quotas(self, pids: Dict[int, int], workers: Dict[int, LocalWorker]) -> None:
        quotas = self.ctx.cpu_quotas
        by_group: Dict[str, List[tuple]] = {}
        for key, worker in workers.items():
            if worker.device.group in quotas:
                by_group.setdefault(worker.device.group, []).append((pids[key], worker))
        if not by_group:
            return
        if self._quota_mode() == "cgroup":
            if self._cgroups is None:
                self._cgroups = CgroupQuota(f"{self.ctx.run_id}.{os.getpid()}")
            for group, members in by_group.items():
                self._cgroups.set_quota(group, quotas[group])
                for pid, _ in members:
                    self._cgroups.add(group, pid)
            return
        if self._duty is None:
            self._duty = DutyCycle()
        all_cores = len(os.sched_getaffinity(0))
        for group, members in by_group.items():
            cores = {c for _, worker in members for c in worker.cpus}
            self._duty.add([pid for pid, _ in members], quotas[group] / (len(cores) or all_cores))

    def before_stop(self) -> None:
        # A stopped process does not act on SIGTERM: let the workers run before
        # the agent signals them, or a graceful stop would always time out.
        if self._duty is not None:
            self._duty.release()

    def forget_worker(self, pid: int) -> None:
        if self._duty is not None:
            self._duty.release([pid])

    def shutdown(self) -> None:
        if self._duty is not None:
            self._duty.release()
            self._duty = None
        if self._cgroups is not None:
            self._cgroups.remove()
            self._cgroups = None

    @classmethod
    def collect_stale(cls) -> List[str]:
        return collect_stale_cgroups()
