"""``LaunchRequest``: what kaitianrun was asked to run on this node, beyond torchrun's ``LaunchConfig``.

Decided once from the command line, before the agent starts, and the same for
every start of the workers (a start's own record is
:class:`~kaitian.launcher.attempt.Attempt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from kaitian.launcher.workers import NodeWorkers
from kaitian.launcher.rundir import RunDir
from kaitian.launcher.runtimes import Runtime

__all__ = ["LaunchRequest"]


@dataclass
class LaunchRequest:
    """What kaitian adds to torch's ``LaunchConfig``.

    Attributes:
        node: this node's workers.
        run_dir: this agent's run directory.
        runtime: the runtime that starts the workers (shut down at the end).
        capabilities: device key -> samples/s.
        monitor_dir: ``--monitor`` directory or ``None``.
        omp_from_user: the user set ``OMP_NUM_THREADS``.
        worker_store_port: node 0 serves the workers' store on this port on
            every start (``None``: torchrun's port, then a free one per restart).
        on_failure: ``restart`` or ``continue`` (``--on-failure``).
        min_nodes: ``--nnodes`` MIN (continue mode: the fewest nodes the job goes on with).
    """

    node: NodeWorkers
    run_dir: RunDir
    runtime: Runtime
    capabilities: Dict[str, float] = field(default_factory=dict)
    monitor_dir: Optional[str] = None
    omp_from_user: bool = False
    worker_store_port: Optional[int] = None
    on_failure: str = "restart"
    min_nodes: int = 1

    @property
    def continues(self) -> bool:
        """``--on-failure continue``: workers are watched and started again one by one."""
        return self.on_failure == "continue"
