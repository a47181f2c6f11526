"""A worker's environment: made here, once, whatever runtime starts it.

torch's variables for the worker (what torchrun would set), kaitian's
``KAITIAN_*`` settings, and what the worker sees of the devices, from this
start's :class:`~kaitian.launcher.attempt.Attempt` and the worker's
:class:`~kaitian.launcher.workers.LocalWorker`. A runtime receives the result
complete and decides only where the process runs (it starts it, as torch does
a local subprocess, under the agent's own environment).
"""

from __future__ import annotations

from typing import Dict, Optional

from kaitian.devices.device import ContainerDevices
from kaitian.devices.visible import worker_visibility
from kaitian.launcher.attempt import Attempt
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.request import LaunchRequest
from kaitian.settings import Settings
from kaitian.version import versions

__all__ = ["worker_environment"]


def worker_environment(
    worker: LocalWorker,
    attempt: Attempt,
    request: LaunchRequest,
    member: str,
    *,
    restart_count: Optional[int] = None,
    container: Optional[ContainerDevices] = None,
) -> Dict[str, str]:
    """The variables the agent sets for one worker of ``attempt``.

    Args:
        worker: the worker's record (:class:`~kaitian.launcher.workers.NodeWorkers`).
        attempt: this start.
        request: the launch (capabilities, ``--monitor``, continue mode, what
            workers may see of other devices).
        member: its member id in the elastic job (continue mode).
        restart_count: a worker started again alone (continue mode, as a
            joiner): its ``TORCHELASTIC_RESTART_COUNT``.
        container: the devices of the container it runs in (``None``: the host).

    Returns:
        torch's variables, under kaitian's, under the device visibility.
    """
    env = dict(attempt.torchrun[worker.local_rank][1])
    capability = request.capabilities.get(worker.device.key)
    elastic = dict(
        elastic_id=member, elastic_run=attempt.elastic_run, elastic_min_nodes=request.min_nodes,
        elastic_join=attempt.joining or restart_count is not None,
    ) if request.continues else {}
    env.update(Settings.for_device(
        worker.device, run_dir=attempt.start_dir, job_key=attempt.job_key, agent_version=versions(),
        capability=None if capability is None else float(capability), monitor_dir=request.monitor_dir, **elastic,
    ).to_env())
    if worker.cpus and worker.device.type == "cpu" and not request.omp_from_user:
        env["OMP_NUM_THREADS"] = str(len(worker.cpus))
    if attempt.agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # an agent serves it: rank 0 must not
    if restart_count is not None:
        env["TORCHELASTIC_RESTART_COUNT"] = str(restart_count)
    node = request.node
    env.update(worker_visibility(worker.device, hide_other_vendors=node.hide_other_vendors,
                                 own_device_only=node.own_device_only, container=container))
    return env
