"""What a subprocess worker in ``tests/workers/`` knows about itself.

The one convention for workers: a worker is a torchrun-style script. It takes
its rank and world from torchrun's environment (``support.ranks.run_ranks`` sets
it, as kaitianrun does), initialises its process group with ``env://`` and
writes its results as JSON lines to the file named by ``KT_OUT``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List

__all__ = ["RankEnv", "rank_env"]


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
