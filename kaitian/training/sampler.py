"""A distributed sampler whose per-rank batch follows each device's speed.

The global batch (``batch_size`` x world size, the same as with torch's
sampler) is split across ranks in proportion to their capability (measured
samples/s), so every rank takes about the same time per step. Every rank runs
the same number of steps per epoch, and every sample is used exactly once per
epoch; the only exception is documented padding when the last step has fewer
samples than there are ranks.

Epoch layout (``N`` samples, global batch ``B``, split ``b_0 .. b_{W-1}``)::

    permutation(seed + epoch) -> [ step 0: b_0 | b_1 | ... ][ step 1 ] ... [ last ]
    steps = N // B full steps, plus one short step with the remaining N % B
    samples split in proportion to b_r (each rank >= 1, <= b_r); if fewer than
    W remain, the first samples of the permutation are repeated so that each
    rank has one (padding, at most W - 1 samples). drop_last=True drops the
    short step instead.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from kaitian.settings import settings
from kaitian.errors import SplitError

__all__ = [
    "DistributedSampler",
    "optimize_batch_size",
    "proportional_split",
    "gather_capabilities",
    "SplitError",
]

_log = logging.getLogger(__name__)

# The most recently created sampler; ``optimize_batch_size`` answers from it.
_LAST_SAMPLER: Optional["DistributedSampler"] = None


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
    # Taking the minimum may overshoot; take back from the largest holders.
    excess = sum(base.values()) - remaining
    while excess > 0:
        i = max(free, key=lambda j: (base[j] - minimum, -j))
        if base[i] <= minimum:
            raise SplitError(f"cannot give {n} ranks at least {minimum} of {total} items")
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


def _default_device() -> torch.device:
    from kaitian.devices.rank import device

    return device()


def gather_capabilities(
    own: Optional[float],
    group: Optional[dist.ProcessGroup] = None,
) -> List[Optional[float]]:
    """Every rank's capability, exchanged through the process group.

    Each rank writes its value into its own slot of a zero vector and the
    vectors are summed, so the result is bit-identical on every rank (x + 0 is
    exact) and all ranks derive the same split.

    Args:
        own: this rank's capability (samples/s), or ``None`` if unknown.
        group: the process group (default: the world).

    Returns:
        One entry per rank of the group, ``None`` where unknown.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    slots = torch.zeros(world, dtype=torch.float32, device=_default_device())
    slots[rank] = float(own) if own is not None and own > 0 else -1.0
    dist.all_reduce(slots, group=group)
    return [None if v <= 0 else float(v) for v in slots.cpu().tolist()]


def _fill_unknown(capabilities: Sequence[Optional[float]]) -> List[float]:
    """Unknown capabilities get the mean of the known ones (all unknown: equal)."""
    known = [c for c in capabilities if c is not None and c > 0]
    fill = sum(known) / len(known) if known else 1.0
    return [float(c) if c is not None and c > 0 else fill for c in capabilities]


def _weak_callable(callback):
    """A weak reference to a bound method (no sampler <-> re-balancer cycle), else a strong one."""
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        return weakref.WeakMethod(callback)
    return lambda: callback


class _Pending:
    """A split change waiting to take effect."""

    def __init__(self, sizes: List[int], at_draw: Optional[int]) -> None:
        self.sizes = sizes
        self.at_draw = at_draw  # None: at the start of the next epoch


class DistributedSampler(Sampler[int]):
    """Like ``torch.utils.data.DistributedSampler``, with per-rank batches ∝ capability.

    Use it either way:

    * classic: ``DataLoader(ds, batch_size=sampler.local_batch_size, sampler=sampler)``
      (the split is fixed while that loader lives; rebuild the loader after
      ``set_epoch`` if a :class:`kaitian.Rebalancer` may change the split);
    * adaptive: ``DataLoader(ds, batch_sampler=sampler.batch_sampler())`` -
      follows split changes by itself, also within an epoch.

    Args:
        dataset: the dataset (only its length is used).
        batch_size: the per-rank batch of an equal split, as you would give
            torch's DataLoader; the global batch is ``batch_size * num_replicas``.
        num_replicas: number of ranks (default: the process group's world size,
            1 without a process group).
        rank: this rank (default: the process group rank, 0 without one).
        shuffle: shuffle with ``seed + epoch``.
        seed: base seed; must be the same on every rank.
        drop_last: drop the last, short step instead of splitting it.
        capabilities: samples/s per rank (sequence or ``{rank: value}``). Default:
            each rank's ``KAITIAN_CAPABILITY``, exchanged through the process
            group; equal split when unknown.
        group: process group used to exchange capabilities.

    Raises:
        SplitError: the batch cannot be split (e.g. ``batch_size < 1``).
        ValueError: ``rank`` is out of range.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        capabilities: Optional[Union[Sequence[Optional[float]], Mapping[int, float]]] = None,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        global _LAST_SAMPLER
        initialized = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size(group) if initialized else 1
        if rank is None:
            rank = dist.get_rank(group) if initialized else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}]")
        if int(batch_size) < 1:
            raise SplitError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.global_batch_size = self.batch_size * self.num_replicas
        self.capabilities = self._resolve_capabilities(capabilities, initialized, group)
        self._split = proportional_split(self.global_batch_size, self.capabilities)
        self._pending: Optional[_Pending] = None
        self._draws = 0  # batches handed out by batch_sampler(), over all epochs
        self._batch_mode = False  # batch_sampler() was asked for
        self._listeners: List = []
        self._epoch_hooks: List = []
        _LAST_SAMPLER = self
        _log.info(
            "rank %d: global batch %d split %s (capabilities %s)",
            self.rank, self.global_batch_size, self._split, self.capabilities,
        )

    # -- capabilities and split -------------------------------------------------

    def _resolve_capabilities(self, capabilities, initialized, group) -> List[float]:
        if capabilities is not None:
            if isinstance(capabilities, Mapping):
                values = [capabilities.get(r) for r in range(self.num_replicas)]
            else:
                values = list(capabilities)
            if len(values) != self.num_replicas:
                raise SplitError(
                    f"capabilities has {len(values)} entries for {self.num_replicas} ranks"
                )
            return _fill_unknown(values)
        own = settings().capability
        if initialized and self.num_replicas == dist.get_world_size(group) > 1:
            return _fill_unknown(gather_capabilities(own, group))
        return [1.0] * self.num_replicas

    @property
    def split(self) -> List[int]:
        """The current per-rank batch sizes (sum = global batch)."""
        return list(self._split)

    @property
    def local_batch_size(self) -> int:
        """This rank's batch per step under the current split."""
        return self._split[self.rank]

    def set_split(self, batch_sizes: Sequence[int], after_draws: Optional[int] = None) -> None:
        """Changes the per-rank batch sizes. Call it with the same values on every rank.

        Args:
            batch_sizes: one positive size per rank; they must add up to the
                global batch, so the number of steps per epoch stays the same.
            after_draws: ``None`` applies the split from the next epoch (next
                ``__iter__``). An integer ``k`` applies it to the batch sampler
                after ``k`` more batches are drawn (``0`` = the next batch), so
                a change may take effect within an epoch; every rank must make
                it at the same point of its program.

        Raises:
            SplitError: wrong length, a size below 1, or the wrong sum.
        """
        sizes = [int(s) for s in batch_sizes]
        if len(sizes) != self.num_replicas:
            raise SplitError(f"split has {len(sizes)} entries for {self.num_replicas} ranks")
        if min(sizes) < 1:
            raise SplitError(f"every rank needs a batch of at least 1, got {sizes}")
        if sum(sizes) != self.global_batch_size:
            raise SplitError(
                f"split {sizes} adds up to {sum(sizes)}, not the global batch {self.global_batch_size}"
            )
        at = None if after_draws is None else self._draws + int(after_draws)
        self._pending = _Pending(sizes, at)

    def add_split_listener(self, callback) -> None:
        """Calls ``callback(old_split, new_split)`` whenever a new split takes effect."""
        self._listeners.append(_weak_callable(callback))

    def _apply_pending(self, at_epoch_start: bool) -> None:
        p = self._pending
        if p is None:
            return
        if at_epoch_start or (p.at_draw is not None and self._draws >= p.at_draw):
            old, self._split, self._pending = self._split, list(p.sizes), None
            if old != self._split:
                _log.info("rank %d: new split %s (was %s)", self.rank, self._split, old)
                for ref in list(self._listeners):
                    cb = ref()
                    if cb is not None:
                        cb(old, list(self._split))

    # -- epoch layout -------------------------------------------------------------

    def __len__(self) -> int:
        """Samples this rank yields per epoch under the current split."""
        full, rest = self._layout()
        own = full * self._split[self.rank]
        if rest:
            own += rest[self.rank]
        return own

    @property
    def num_steps(self) -> int:
        """Steps per epoch; the same on every rank."""
        full, rest = self._layout()
        return full + (1 if rest else 0)

    def _layout(self, split: Optional[List[int]] = None):
        """(full steps, per-rank sizes of the short last step or None)."""
        split = self._split if split is None else split
        n = len(self.dataset)
        if n == 0:
            raise SplitError("the dataset is empty")
        full, remainder = divmod(n, self.global_batch_size)
        if remainder == 0 or self.drop_last:
            if full == 0:
                raise SplitError(
                    f"drop_last=True with {n} samples and a global batch of "
                    f"{self.global_batch_size} leaves no step; lower batch_size"
                )
            return full, None
        # Pad the last step to one sample per rank at least.
        remainder = max(remainder, self.num_replicas)
        return full, proportional_split(remainder, split, caps=split)

    def _permutation(self) -> List[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    @staticmethod
    def _take(perm: List[int], start: int, count: int) -> List[int]:
        """``count`` indices from ``start``, wrapping round (padding)."""
        n = len(perm)
        if start + count <= n:
            return perm[start:start + count]
        return [perm[(start + i) % n] for i in range(count)]

    def _step_indices(self, perm: List[int], step: int, full: int, rest, split) -> List[int]:
        sizes = split if step < full else rest
        start = step * self.global_batch_size + sum(sizes[: self.rank])
        return self._take(perm, start, sizes[self.rank])

    def __iter__(self) -> Iterator[int]:
        before = list(self._split)
        self._apply_pending(at_epoch_start=True)
        if self._split != before and not self._batch_mode:
            # A DataLoader(batch_size=...) keeps the old size: ranks would then
            # run different numbers of steps and the job would hang.
            _log.warning(
                "rank %d: the split changed to %s; a DataLoader built with "
                "batch_size=%d must be rebuilt (or use batch_sampler=sampler.batch_sampler())",
                self.rank, self._split, before[self.rank],
            )
        perm = self._permutation()
        full, rest = self._layout()
        split = list(self._split)
        for step in range(full + (1 if rest else 0)):
            yield from self._step_indices(perm, step, full, rest, split)

    def epoch_batches(self) -> Iterator[List[int]]:
        """This rank's batches for the current epoch, following split changes."""
        self._apply_pending(at_epoch_start=True)
        perm = self._permutation()
        full, _ = self._layout()
        steps = self.num_steps
        for step in range(steps):
            self._apply_pending(at_epoch_start=False)
            split = list(self._split)
            _, rest = self._layout(split)
            self._draws += 1
            yield self._step_indices(perm, step, full, rest, split)

    def batch_sampler(self) -> "_BatchSampler":
        """A batch sampler for ``DataLoader(ds, batch_sampler=...)`` that follows the split."""
        self._batch_mode = True
        return _BatchSampler(self)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (reshuffles with ``seed + epoch``); call it before each epoch."""
        self.epoch = int(epoch)
        for ref in list(self._epoch_hooks):
            cb = ref()
            if cb is not None:
                cb(self.epoch)

    def add_epoch_hook(self, callback) -> None:
        """Calls ``callback(epoch)`` from :meth:`set_epoch` (used by the re-balancer)."""
        self._epoch_hooks.append(_weak_callable(callback))

    def state(self) -> Dict[str, object]:
        """A summary for logs: rank, split, capabilities, steps."""
        return {
            "rank": self.rank,
            "split": self.split,
            "capabilities": list(self.capabilities),
            "steps": self.num_steps,
        }


class _BatchSampler:
    """Yields this rank's index lists step by step, reading the split lazily."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[List[int]]:
        return self.sampler.epoch_batches()

    def __len__(self) -> int:
        return self.sampler.num_steps


def optimize_batch_size(batch_size: int) -> int:
    """This rank's local batch for a per-rank ``batch_size`` (the original API).

    Answers from the last :class:`DistributedSampler` created with that
    ``batch_size``; without one, splits by the gathered capabilities (a
    collective: call it on every rank).

    Args:
        batch_size: the per-rank batch of an equal split.

    Returns:
        This rank's batch under the capability split.
    """
    s = _LAST_SAMPLER
    if s is not None and s.batch_size == int(batch_size):
        return s.local_batch_size
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized:
        return int(batch_size)
    world = dist.get_world_size()
    caps = _fill_unknown(gather_capabilities(settings().capability))
    return proportional_split(int(batch_size) * world, caps)[dist.get_rank()]
