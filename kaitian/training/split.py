"""How the global batch is cut across ranks: the split algorithm, the split in force, each rank's capability,
the re-balancer's choice of split (``balanced_split``).

Everything here is deterministic: ranks that feed it the same numbers get the
same split, so after one exchange of bit-identical values
(:mod:`kaitian.training.exchange`) every rank derives the split on its own,
with no further agreement round.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch.distributed as dist

from kaitian.errors import SplitError
from kaitian.settings import settings
from kaitian.training.exchange import gather_per_rank
from kaitian.training.listeners import Listeners

__all__ = [
    "proportional_split", "epoch_layout", "SplitSchedule", "balanced_split",
    "gather_capabilities", "rank_capabilities", "optimize_batch_size", "SplitError",
]

Capabilities = Union[Sequence[Optional[float]], Mapping[int, float]]

_log = logging.getLogger(__name__)


def proportional_split(
    total: int,
    weights: Sequence[float],
    caps: Optional[Sequence[Optional[int]]] = None,
    minimum: int = 1,
) -> List[int]:
    """Splits ``total`` items in proportion to ``weights`` (largest remainder).

    Deterministic: ties go to the lower rank. Ranks whose share would exceed
    their cap get the cap and the rest is re-split among the others.

    Args:
        total: items to hand out.
        weights: one non-negative weight per rank (all zero = equal split).
        caps: optional per-rank maximum (``None`` entries = no cap).
        minimum: every rank gets at least this many.

    Returns:
        One count per rank, summing to ``total``.

    Raises:
        SplitError: ``total`` cannot be split within ``minimum`` and ``caps``.
    """
    n = len(weights)
    if n == 0:
        raise SplitError("cannot split a batch across zero ranks")
    caps_list = [None] * n if caps is None else [None if c is None else int(c) for c in caps]
    if len(caps_list) != n:
        raise SplitError(f"got {len(caps_list)} caps for {n} ranks")
    if total < minimum * n:
        raise SplitError(f"cannot give {n} ranks at least {minimum} of {total} items")
    if any(c is not None and c < minimum for c in caps_list):
        raise SplitError(f"a per-rank cap is below the minimum of {minimum}")
    if all(c is not None for c in caps_list) and sum(caps_list) < total:
        raise SplitError(
            f"per-rank maximum batches {caps_list} add up to less than the global batch {total}; "
            "raise max_batch_size or lower batch_size"
        )
    w = [max(0.0, float(x)) if math.isfinite(float(x)) else 0.0 for x in weights]
    if sum(w) <= 0.0:
        w = [1.0] * n
    result = [0] * n
    fixed = [False] * n
    # Water-filling: fix capped ranks until the proportional share fits everyone.
    while True:
        free = [i for i in range(n) if not fixed[i]]
        remaining = total - sum(result[i] for i in range(n) if fixed[i])
        free_w = sum(w[i] for i in free)
        if free_w <= 0.0:
            shares = {i: remaining / len(free) for i in free}
        else:
            shares = {i: remaining * w[i] / free_w for i in free}
        over = [i for i in free if caps_list[i] is not None and shares[i] > caps_list[i]]
        if not over:
            break
        for i in over:
            result[i] = caps_list[i]
            fixed[i] = True
    # Give each free rank its minimum first, then the rest by largest remainder.
    free = [i for i in range(n) if not fixed[i]]
    remaining = total - sum(result[i] for i in range(n) if fixed[i])
    base = {i: max(minimum, int(math.floor(shares[i]))) for i in free}
    # Taking the minimum may overshoot; take back from whoever holds most beyond its
    # share (never from a faster rank before a slower one).
    excess = sum(base.values()) - remaining
    while excess > 0:
        above = [j for j in free if base[j] > minimum]
        if not above:
            raise SplitError(f"cannot give {n} ranks at least {minimum} of {total} items")
        i = max(above, key=lambda j: (base[j] - shares[j], -j))
        base[i] -= 1
        excess -= 1
    left = remaining - sum(base.values())
    # Ranks lifted to the minimum already got more than their share: last in line.
    order = sorted(free, key=lambda j: (-(shares[j] - base[j]), j))
    k = 0
    guard = 0
    while left > 0:
        i = order[k % len(order)]
        if caps_list[i] is None or base[i] < caps_list[i]:
            base[i] += 1
            left -= 1
        k += 1
        guard += 1
        if guard > 10 * (total + n):
            raise SplitError(f"cannot split {total} items under caps {caps_list}")
    for i in free:
        result[i] = base[i]
    return result


def epoch_layout(
    samples: int, split: Sequence[int], minimum: int = 1, drop_last: bool = False,
) -> Tuple[int, Optional[List[int]]]:
    """How an epoch of ``samples`` is cut into steps of the global batch ``sum(split)``.

    Returns:
        (full steps, per-rank sizes of the short last step or ``None``). The
        short step's ``samples % sum(split)`` are split in proportion to
        ``split`` (each rank at most its share), padded so that each rank has
        ``minimum``; ``drop_last`` drops it.

    Raises:
        SplitError: no samples, or ``drop_last`` leaves no step.
    """
    if samples == 0:
        raise SplitError("the dataset is empty")
    full, remainder = divmod(samples, sum(split))
    if remainder == 0 or drop_last:
        if full == 0:
            raise SplitError(
                f"drop_last=True with {samples} samples and a global batch of {sum(split)} leaves no step; "
                "lower batch_size"
            )
        return full, None
    return full, _over_training_ranks(split, lambda shares: proportional_split(
        max(remainder, minimum * len(shares)), shares, caps=shares, minimum=minimum))


def _over_training_ranks(split: Sequence[int], cut) -> List[int]:
    """``cut(shares)`` applied to the ranks with a share (benched ranks, with none, keep none)."""
    training = [r for r, n in enumerate(split) if n > 0]
    out = [0] * len(split)
    for r, n in zip(training, cut([split[r] for r in training])):
        out[r] = n
    return out


class SplitSchedule:
    """The split in force: the per-rank batch sizes and at most one change waiting for the
    next epoch or for a number of batches to be drawn.

    Each rank keeps its own; changed alike at the same points of every rank's
    program, the ranks' schedules agree without a message.

    Args:
        split: the first split; its sum is the global batch, for good.
        minimum: the smallest batch any rank may get.
    """

    def __init__(self, split: Sequence[int], minimum: int) -> None:
        self.current = list(split)
        self.global_batch_size = sum(self.current)
        self.minimum = minimum
        # A rank may get no samples (benched) only where its rank then leaves every per-step
        # collective: kaitian.Rebalancer(..., optimizer=) turns this on.
        self.benching = False
        self.draws = 0  # batches drawn, over all epochs
        self.listeners = Listeners()  # callback(old_split, new_split)
        self._pending: Optional[Tuple[List[int], Optional[int]]] = None  # (split, at draw; None: next epoch)

    def _checked(self, sizes: Sequence[int], ranks: int) -> List[int]:
        """``sizes`` as a split of the global batch over ``ranks`` ranks.

        Raises:
            SplitError: wrong length, a size below the minimum, or the wrong sum.
        """
        sizes = [int(s) for s in sizes]
        if len(sizes) != ranks:
            raise SplitError(f"split has {len(sizes)} entries for {ranks} ranks")
        if min((s for s in sizes if s > 0 or not self.benching), default=0) < self.minimum:
            raise SplitError(f"every rank needs a batch of at least {self.minimum}, got {sizes}"
                             + ("" if self.benching else " (a rank gets none only through "
                                "kaitian.Rebalancer(..., optimizer=), which takes it out of the exchange)"))
        if sum(sizes) != self.global_batch_size:
            raise SplitError(f"split {sizes} adds up to {sum(sizes)}, not the global batch {self.global_batch_size}")
        return sizes

    def change(self, sizes: Sequence[int], after_draws: Optional[int]) -> None:
        """``sizes`` from the next epoch (``after_draws=None``) or after ``after_draws`` more draws."""
        sizes = self._checked(sizes, len(self.current))
        at = None if after_draws is None else self.draws + int(after_draws)
        if at is not None and any(now > 0 and was == 0 for now, was in zip(sizes, self.current)):
            raise SplitError(f"split {sizes} calls back a benched rank of {self.current}: "
                             "that takes effect at an epoch start (after_draws=None)")
        self._pending = (sizes, at)

    def replace(self, sizes: Sequence[int], ranks: int) -> None:
        """``sizes`` over ``ranks`` ranks (another world) from now on; a waiting change is dropped."""
        self.current, self._pending = self._checked(sizes, ranks), None

    def raise_minimum(self, minimum: int) -> None:
        """Lifts every rank, now and in a waiting change, to at least ``minimum``."""
        if minimum <= self.minimum:
            return
        if minimum * len(self.current) > self.global_batch_size:
            raise SplitError(f"a minimum batch of {minimum} per rank needs a global batch of at least "
                             f"{minimum * len(self.current)}, not {self.global_batch_size}; raise batch_size")
        self.minimum = minimum

        def lift(sizes: Sequence[int]) -> List[int]:
            return _over_training_ranks(
                sizes, lambda shares: proportional_split(self.global_batch_size, shares, minimum=minimum))

        self.current = lift(self.current)
        if self._pending is not None:
            sizes, at = self._pending
            self._pending = (lift(sizes), at)

    def before_batch(self, at_epoch_start: bool, draw: bool) -> None:
        """Applies a change that is due before the next batch; ``draw``: count that batch as drawn."""
        if self._pending is not None:
            sizes, at = self._pending
            if at_epoch_start or (at is not None and self.draws >= at):
                old, self.current, self._pending = self.current, sizes, None
                if old != sizes:
                    _log.info("new split %s (was %s)", sizes, old)
                    self.listeners(old, list(sizes))
        self.draws += int(draw)

    @property
    def at_epoch_start(self) -> List[int]:
        """The split the next epoch starts with: a change still waiting takes effect there."""
        return list(self._pending[0] if self._pending is not None else self.current)

    def state_dict(self) -> Dict[str, Any]:
        pending = None
        if self._pending is not None:
            sizes, at = self._pending
            pending = [list(sizes), None if at is None else max(0, at - self.draws)]
        return {"split": list(self.current), "pending": pending}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.current = [int(s) for s in state["split"]]
        pending = state.get("pending")
        self._pending = None if not pending else (
            [int(s) for s in pending[0]], None if pending[1] is None else self.draws + int(pending[1]))


def balanced_split(
    global_batch: int,
    per_sample_s: Sequence[float],
    current: Sequence[int],
    caps: Optional[Sequence[Optional[int]]] = None,
    min_gain: float = 0.03,
    minimum: int = 1,
) -> List[int]:
    """The split that equalises compute time, or ``current`` if the gain is too small.

    Args:
        global_batch: samples per step over all ranks.
        per_sample_s: each rank's compute seconds per sample (> 0).
        current: the split in use.
        caps: per-rank maximum batch (``None`` = no cap).
        min_gain: keep ``current`` unless the predicted slowest-rank compute
            time drops by more than this fraction (stops jitter from noise).
        minimum: the smallest batch a rank may get.

    Returns:
        The split to use.
    """
    speeds = [1.0 / t for t in per_sample_s]
    candidate = proportional_split(global_batch, speeds, caps=caps, minimum=minimum)

    def slowest(split: Sequence[int]) -> float:
        return max(b * t for b, t in zip(split, per_sample_s))

    if list(candidate) == list(current):
        return list(current)
    if slowest(candidate) < slowest(current) * (1.0 - min_gain):
        return candidate
    return list(current)


def gather_capabilities(
    own: Optional[float],
    group: Optional[dist.ProcessGroup] = None,
) -> List[Optional[float]]:
    """Every rank's capability, exchanged through the process group.

    Bit-identical on every rank (:mod:`kaitian.training.exchange`), so all
    ranks derive the same split.

    Args:
        own: this rank's capability (samples/s), or ``None`` if unknown.
        group: the process group (default: the world).

    Returns:
        One entry per rank of the group, ``None`` where unknown.
    """
    value = float(own) if own is not None and own > 0 else -1.0
    return [None if row[0] <= 0 else row[0] for row in gather_per_rank([value], group)]


def rank_capabilities(
    num_replicas: int,
    capabilities: Optional[Capabilities] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> List[float]:
    """The capability (samples/s) of each of ``num_replicas`` ranks: what the split is proportional to.

    Given ``capabilities`` (a sequence or ``{rank: value}``), those; else each
    rank's ``KAITIAN_CAPABILITY``, exchanged through ``group`` when it has
    ``num_replicas`` ranks (a collective: call it on every rank), else equal.
    Unknown entries get the mean of the known ones (all unknown: equal).

    Raises:
        SplitError: ``capabilities`` has the wrong length.
    """
    if capabilities is not None:
        if isinstance(capabilities, Mapping):
            values = [capabilities.get(r) for r in range(num_replicas)]
        else:
            values = list(capabilities)
        if len(values) != num_replicas:
            raise SplitError(f"capabilities has {len(values)} entries for {num_replicas} ranks")
    elif dist.is_available() and dist.is_initialized() and num_replicas == dist.get_world_size(group) > 1:
        values = gather_capabilities(settings().capability, group)
    else:
        values = [None] * num_replicas
    known = [c for c in values if c is not None and c > 0]
    fill = sum(known) / len(known) if known else 1.0
    return [float(c) if c is not None and c > 0 else fill for c in values]


def optimize_batch_size(batch_size: int) -> int:
    """This rank's batch for a per-rank ``batch_size`` (the original API).

    The split of ``batch_size`` x world by the ranks' ``KAITIAN_CAPABILITY``,
    exchanged through the process group (a collective: call it on every rank):
    what ``DistributedSampler(ds, batch_size=batch_size)`` gives this rank with
    default capabilities. Without a process group, ``batch_size``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return int(batch_size)
    world = dist.get_world_size()
    return proportional_split(int(batch_size) * world, rank_capabilities(world))[dist.get_rank()]
