"""What a subprocess worker in ``tests/workers/`` knows about itself.

The one convention for workers: a worker is a torchrun-style script. It takes
its rank and world from torchrun's environment (``support.ranks.run_ranks`` sets
it, as kaitianrun does), initialises its process group with ``env://`` and
writes its results as JSON lines to the file named by ``KT_OUT``, and ends
with :func:`end_process_group` once it has dropped its models.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import List

__all__ = ["RankEnv", "end_process_group", "rank_env"]


@dataclass(frozen=True)
class RankEnv:
    """This worker's place in its run.

    Attributes:
        rank, world_size: from ``RANK`` / ``WORLD_SIZE``.
        groups: every rank's simulated vendor group (``KT_GROUPS``), in rank order.
        out: where to write JSON lines (``KT_OUT``).
    """

    rank: int
    world_size: int
    groups: List[str]
    out: str


def rank_env() -> RankEnv:
    """Reads this worker's :class:`RankEnv` from the environment."""
    world = int(os.environ["WORLD_SIZE"])
    groups = [g for g in os.environ.get("KT_GROUPS", "").split(",") if g] or ["cpu"] * world
    return RankEnv(int(os.environ["RANK"]), world, groups, os.environ["KT_OUT"])


def end_process_group() -> None:
    """Destroys the default process group while the interpreter is still fully alive.

    Call it after the worker's DDP models are gone (returned from, or ``del``).
    torch's gloo threads drop a finished Work just after ``wait()`` returns; if
    the interpreter is already finalizing by then, that thread dies taking the
    GIL and the process aborts ("terminate called without an active
    exception", pytorch/pytorch#190489) - likelier with a rank pinned to one
    core. Collecting the dropped models lets ``destroy_process_group`` free
    the group now, and the group's destructor joins those threads.
    """
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
