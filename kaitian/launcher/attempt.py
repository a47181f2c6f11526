"""``Attempt``: one start of this node's workers, decided once after its rendezvous round.

Everything that holds for one start and for no other is on this record: the
round's placement, the workers' store, the job key, the elastic run, the start
directory, whether the workers join a running job, and what torch gives each
worker (its torchrun arguments and environment). The agent makes one per start
and holds the current one; a worker started again alone (``--on-failure
continue``) is started from it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

from kaitian.launcher.rendezvous import NodePlacement

__all__ = ["Attempt"]


@dataclass(frozen=True)
class Attempt:
    """One start of this node's workers.

    Attributes:
        number: this node's starts so far, this one included (1 for the first).
        placement: the round's placement, decided by node 0 (``None``: none was
            agreed, e.g. a test agent without a rendezvous).
        workers_store: the address of the store this start's workers use.
        agent_store: an agent serves that store (``TORCHELASTIC_USE_AGENT_STORE``:
            worker rank 0 must not host one).
        serves_store: this node serves it (node 0, not joining a running job).
        job_key: the secret the workers prove to each other on the TCP bridge.
        elastic_run: the kaitian.elastic run the workers belong to.
        start_dir: this start's ``KAITIAN_RUN_DIR``.
        joining: the workers join a running job (continue mode, a new node).
        torchrun: local rank -> the arguments and environment torch gives the worker.
    """

    number: int
    placement: Optional[NodePlacement]
    workers_store: Tuple[str, int]
    agent_store: bool
    serves_store: bool
    job_key: str
    elastic_run: str
    start_dir: str
    joining: bool = False
    torchrun: Mapping[int, Tuple[tuple, Mapping[str, str]]] = field(default_factory=dict)

    def live_job(self, key_given: bool) -> Dict[str, object]:
        """What a node new to this running job needs to join it (continue mode).

        Args:
            key_given: the job key came to kaitianrun from outside: it is never published.
        """
        return {"store": list(self.workers_store), "run": self.elastic_run, "key": "" if key_given else self.job_key}
