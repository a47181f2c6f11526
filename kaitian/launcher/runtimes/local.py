"""The default runtime: workers are subprocesses of the agent on this host.

Processes are started by torch's own ``start_processes`` (so logs, error
files and signals behave exactly as under torchrun); on top of that each
worker is pinned to its slot's cores and put under its group's CPU quota.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional

from kaitian import _torch as _te
from kaitian.launcher.runtimes.base import RunContext, Runtime, WorkerLaunch, WorkerStart
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

    Reads ``ctx.options.local.numa_options`` and the ``--duplicate-std*-filters``
    of ``ctx.options``.
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
        pcontext = _te.call_supported(
            _te.start_processes,
            name=job.name,
            entrypoint=job.entrypoint,
            args=job.args,
            envs=job.envs,
            logs_specs=job.logs_specs,
            log_line_prefixes=job.log_line_prefixes,
            start_method=job.start_method,
            numa_options=opts.local.numa_options,
            duplicate_stdout_filters=opts.duplicate_stdout_filters,
            duplicate_stderr_filters=opts.duplicate_stderr_filters,
        )
        pids = pcontext.pids()
        for local_rank, launch in job.workers.items():
            pin(pids[local_rank], launch.cpus)
        self._apply_quotas(pids, job.workers)
        return pcontext

    def _apply_quotas(self, pids: Dict[int, int], workers: Dict[int, WorkerLaunch]) -> None:
        by_group: Dict[str, List[WorkerLaunch]] = {}
        for launch in workers.values():
            if launch.cpu_quota is not None:
                by_group.setdefault(launch.device.group, []).append(launch)
        if not by_group:
            return
        if self._quota_mode() == "cgroup":
            if self._cgroups is None:
                self._cgroups = CgroupQuota(f"{self.ctx.run_id}.{os.getpid()}")
            for group, launches in by_group.items():
                self._cgroups.set_quota(group, launches[0].cpu_quota)
                for launch in launches:
                    self._cgroups.add(group, pids[launch.local_rank])
            return
        if self._duty is None:
            self._duty = DutyCycle()
        all_cores = len(os.sched_getaffinity(0))
        for group, launches in by_group.items():
            cores = {c for launch in launches for c in launch.cpus}
            fraction = launches[0].cpu_quota / (len(cores) or all_cores)
            self._duty.add([pids[launch.local_rank] for launch in launches], fraction)

    def before_stop(self) -> None:
        # A stopped process does not act on SIGTERM: let the workers run before
        # the agent signals them, or a graceful stop would always time out.
        if self._duty is not None:
            self._duty.release()

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
