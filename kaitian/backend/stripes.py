"""Stripe weights: how much of each all_reduce every rank reduces on the host.

Across groups, kaitian's all_reduce is a reduce-scatter then an all-gather:
rank r reduces one stripe of every segment, and by default the stripes are
equal, so the slowest rank reduces 1/W of the tensor at its own speed.
:func:`balance_stripes` gives each rank a stripe in proportion to its measured
host reduce speed; :func:`set_stripe_weights` sets weights directly.

Every rank must set the same weights at the same point of its sequence of
collectives (a step boundary, say): the weights' digest is part of each
all_reduce's identity, so ranks that disagree fail that all_reduce on every
rank, naming both calls, instead of reducing different stripes.
:func:`balance_stripes` is itself a collective (an all_gather of the speeds),
so every rank computes the same weights from the same numbers.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["WEIGHT_SCALE", "balance_stripes", "kaitian_backend", "reduce_speed", "set_stripe_weights",
           "stripe_weights", "weights_for"]

# Weights are integers (identical bit for bit on every rank); speeds become
# parts of this total.
WEIGHT_SCALE = 1 << 16


def kaitian_backend(group: Optional[dist.ProcessGroup] = None):
    """The kaitian backend (``kaitian._C.KaitianBackend``) of ``group`` (default: the default group).

    Raises:
        ValueError: the group does not run on backend kaitian.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except RuntimeError:
        backend = None
    if not hasattr(backend, "set_stripe_weights"):
        raise ValueError(f"stripe weights need a process group on backend kaitian, not {dist.get_backend(pg)}")
    return backend


def set_stripe_weights(weights: Optional[Sequence[int]], group: Optional[dist.ProcessGroup] = None) -> None:
    """From the next all_reduce on, rank r reduces ``weights[r] / sum(weights)`` of every segment.

    Args:
        weights: one non-negative integer per rank (not all 0), or ``None``
            for even stripes. Every rank must pass the same weights at the
            same point between collectives.
        group: the process group (default: the default group).

    Raises:
        ValueError: a weight is negative or not an integer, all are 0, or
            there is not one per rank.
    """
    values: List[int] = []
    for w in weights or ():
        if isinstance(w, bool) or int(w) != w:
            raise ValueError(f"kaitian set_stripe_weights: weights are integers, got {w!r}")
        values.append(int(w))
    kaitian_backend(group).set_stripe_weights(values)


def stripe_weights(group: Optional[dist.ProcessGroup] = None) -> Optional[List[int]]:
    """The weights the next all_reduce uses (``None``: even stripes)."""
    return list(kaitian_backend(group).stripe_weights()) or None


def reduce_speed(group: Optional[dist.ProcessGroup] = None) -> float:
    """Elements per second this rank has reduced on the host so far (0 before any host reduction)."""
    elements, seconds = kaitian_backend(group).reduce_rate()
    return elements / seconds if seconds > 0 else 0.0


def balance_stripes(group: Optional[dist.ProcessGroup] = None, min_spread: float = 1.25) -> Optional[List[int]]:
    """Weighs every rank's stripe by its measured host reduce speed (a collective: call it on every rank).

    Each rank's speed is its host reductions' elements per second so far
    (:func:`reduce_speed`); the ranks all-gather them and every rank turns
    the same numbers into the same integer weights. Where the speeds are
    within ``min_spread`` of each other, or a rank has not reduced yet,
    stripes stay even.

    Returns:
        The weights set, or ``None`` for even stripes.
    """
    speeds = torch.tensor([reduce_speed(group)], dtype=torch.float64)
    world = dist.get_world_size(group)
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, speeds, group=group)
    weights = weights_for([float(s) for s in gathered], min_spread)
    set_stripe_weights(weights, group)
    return weights


def weights_for(speeds: Sequence[float], min_spread: float = 1.25) -> Optional[List[int]]:
    """Integer stripe weights in proportion to ``speeds`` (every rank's, the same list on every rank);
    ``None`` (even stripes) where they are within ``min_spread`` of each other or one is unknown (0)."""
    if not speeds or min(speeds) <= 0 or max(speeds) / min(speeds) < min_spread:
        return None
    total = sum(speeds)
    return [max(1, round(v / total * WEIGHT_SCALE)) for v in speeds]
