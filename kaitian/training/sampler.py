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
    samples split in proportion to b_r (each rank >= min_batch_size, <= b_r);
    if fewer than W x min_batch_size remain, the first samples of the
    permutation are repeated so that each rank has its minimum (padding, at
    most W x min_batch_size - 1 samples). drop_last=True drops the short step
    instead.
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.utils.data

from kaitian.errors import SplitError
from kaitian.settings import settings
from kaitian.training.exchange import gather_per_rank
from kaitian.training.listeners import Listeners

__all__ = [
    "DistributedSampler",
    "KaitianBatchSampler",
    "optimize_batch_size",
    "proportional_split",
    "gather_capabilities",
    "latest_sampler",
    "kaitian_sampler_of",
    "SplitError",
    "DEFAULT_BATCH_SIZE",
]

_log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32  # per rank of an equal split, when batch_size is not given

# The most recently created sampler (weakly): optimize_batch_size and
# scale_loss answer from it.
_latest: Optional["weakref.ref"] = None
_latest_local: Optional[tuple] = None  # (batch_size, local batch) of that sampler, kept after it is gone


def latest_sampler() -> Optional["DistributedSampler"]:
    """The most recently created :class:`DistributedSampler` still alive, or ``None``."""
    return _latest() if _latest is not None else None


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


def _fill_unknown(capabilities: Sequence[Optional[float]]) -> List[float]:
    """Unknown capabilities get the mean of the known ones (all unknown: equal)."""
    known = [c for c in capabilities if c is not None and c > 0]
    fill = sum(known) / len(known) if known else 1.0
    return [float(c) if c is not None and c > 0 else fill for c in capabilities]


class _Pending:
    """A split change waiting to take effect."""

    def __init__(self, sizes: List[int], at_draw: Optional[int]) -> None:
        self.sizes = sizes
        self.at_draw = at_draw  # None: at the start of the next epoch


def _calling_batch_sampler() -> Optional[torch.utils.data.BatchSampler]:
    """The torch ``BatchSampler`` iterating this sampler, if that is who asks.

    ``DataLoader(batch_size=B, sampler=s)`` wraps ``s`` in a ``BatchSampler``
    whose ``__iter__`` frame drives ours; reading it lets the first step say
    that ``B`` does not match this rank's share of the split.
    """
    try:
        caller = sys._getframe(2).f_locals.get("self")
    except (ValueError, AttributeError):
        return None
    if isinstance(caller, torch.utils.data.BatchSampler) and not isinstance(caller, KaitianBatchSampler):
        return caller
    return None


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's ``DistributedSampler`` with per-rank batches in proportion to each device's speed.

    A subclass of ``torch.utils.data.DistributedSampler`` with its constructor
    (so Lightning and Accelerate recognise it and do not shard it again), plus
    ``batch_size``: the per-rank batch of an equal split, as you would give
    torch's DataLoader; the global batch is ``batch_size * num_replicas``.

    Use it either way:

    * adaptive (recommended): ``DataLoader(ds, batch_sampler=sampler.batch_sampler())``
      follows split changes by itself, also within an epoch;
    * classic: ``DataLoader(ds, batch_size=sampler.local_batch_size, sampler=sampler)``;
      the split is fixed while that loader lives. A ``batch_size`` that does
      not match this rank's share is refused at the first step.

    Args:
        dataset: the dataset (only its length is used).
        num_replicas: number of ranks (default: the process group's world size,
            1 without a process group).
        rank: this rank (default: the process group rank, 0 without one).
        shuffle: shuffle with ``seed + epoch``.
        seed: base seed; must be the same on every rank.
        drop_last: drop the last, short step instead of splitting it.
        batch_size: per-rank batch of an equal split (default
            :data:`DEFAULT_BATCH_SIZE` = 32); the split itself follows the
            capabilities.
        capabilities: samples/s per rank (sequence or ``{rank: value}``). Default:
            each rank's ``KAITIAN_CAPABILITY`` (from ``kaitian init``),
            exchanged through the process group; equal split when unknown.
        group: process group used to exchange capabilities.
        min_batch_size: the smallest batch any rank gets in any step (the
            short last step included); 2 suits BatchNorm, which cannot take 1.
            :class:`kaitian.DistributedDataParallel` raises it to 2 when the
            model has BatchNorm.

    Raises:
        SplitError: the batch cannot be split (e.g. ``batch_size < 1``).
        ValueError: ``rank`` is out of range.
    """

    def __init__(
        self,
        dataset,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        batch_size: Optional[int] = None,
        capabilities: Optional[Union[Sequence[Optional[float]], Mapping[int, float]]] = None,
        group: Optional[dist.ProcessGroup] = None,
        min_batch_size: int = 1,
    ) -> None:
        global _latest, _latest_local
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(group) if initialized else None
        if batch_size is None and num_replicas is not None and world is not None and num_replicas != world:
            raise SplitError(
                f"DistributedSampler(dataset, {num_replicas}): the second argument is num_replicas "
                f"(torch's order) but the world has {world} ranks; pass batch_size={num_replicas}"
            )
        if num_replicas is None:
            num_replicas = world if world is not None else 1
        if rank is None:
            rank = dist.get_rank(group) if initialized else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}]")
        batch_size = DEFAULT_BATCH_SIZE if batch_size is None else int(batch_size)
        if batch_size < 1:
            raise SplitError(f"batch_size must be at least 1, got {batch_size}")
        if int(min_batch_size) < 1 or int(min_batch_size) > batch_size:
            raise SplitError(f"min_batch_size must be in [1, batch_size={batch_size}], got {min_batch_size}")
        # torch's attributes, under torch's names
        self.dataset = dataset
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.batch_size = batch_size
        self.min_batch_size = int(min_batch_size)
        self.global_batch_size = self.batch_size * self.num_replicas
        self.capabilities = self._resolve_capabilities(capabilities, initialized, group)
        self._split = proportional_split(self.global_batch_size, self.capabilities, minimum=self.min_batch_size)
        self._pending: Optional[_Pending] = None
        self._draws = 0  # batches handed out by batch_sampler(), over all epochs
        self._epoch_step = 0  # batches handed out in the current epoch
        self._resume_step: Optional[tuple] = None  # (epoch, step) from load_state_dict
        self._batch_mode = False  # batch_sampler() was asked for
        self.last_batch_size = self._split[self.rank]  # size of the batch handed out last
        self._split_listeners = Listeners()
        self._epoch_listeners = Listeners()
        _latest = weakref.ref(self)
        _latest_local = (self.batch_size, self.local_batch_size)
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

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch (torch's attribute)."""
        return len(self)

    @property
    def total_size(self) -> int:
        """Samples all ranks yield per epoch, padding included (torch's attribute)."""
        full, rest = self._layout()
        return full * self.global_batch_size + (sum(rest) if rest else 0)

    def require_min_batch_size(self, minimum: int) -> None:
        """Raises :attr:`min_batch_size` (e.g. to 2 for BatchNorm); re-splits if a rank is below it.

        Call it on every rank alike (it changes the split).
        """
        minimum = int(minimum)
        if minimum <= self.min_batch_size:
            return
        if minimum * self.num_replicas > self.global_batch_size:
            raise SplitError(
                f"a minimum batch of {minimum} per rank needs a global batch of at least "
                f"{minimum * self.num_replicas}, not {self.global_batch_size}; raise batch_size"
            )
        self.min_batch_size = minimum
        if min(self._split) < minimum:
            self._split = proportional_split(self.global_batch_size, self._split, minimum=minimum)

    def set_split(self, batch_sizes: Sequence[int], after_draws: Optional[int] = None) -> None:
        """Changes the per-rank batch sizes. Call it with the same values on every rank.

        Args:
            batch_sizes: one size per rank, each at least :attr:`min_batch_size`;
                they must add up to the global batch, so the number of steps
                per epoch stays the same.
            after_draws: ``None`` applies the split from the next epoch (next
                ``__iter__``). An integer ``k`` applies it to the batch sampler
                after ``k`` more batches are drawn (``0`` = the next batch), so
                a change may take effect within an epoch; every rank must make
                it at the same point of its program.

        Raises:
            SplitError: wrong length, a size below the minimum, or the wrong sum.
        """
        sizes = [int(s) for s in batch_sizes]
        if len(sizes) != self.num_replicas:
            raise SplitError(f"split has {len(sizes)} entries for {self.num_replicas} ranks")
        if min(sizes) < self.min_batch_size:
            raise SplitError(f"every rank needs a batch of at least {self.min_batch_size}, got {sizes}")
        if sum(sizes) != self.global_batch_size:
            raise SplitError(
                f"split {sizes} adds up to {sum(sizes)}, not the global batch {self.global_batch_size}"
            )
        at = None if after_draws is None else self._draws + int(after_draws)
        self._pending = _Pending(sizes, at)

    def add_split_listener(self, callback) -> None:
        """Calls ``callback(old_split, new_split)`` whenever a new split takes effect."""
        self._split_listeners.add(callback)

    def _apply_pending(self, at_epoch_start: bool) -> None:
        p = self._pending
        if p is None:
            return
        if at_epoch_start or (p.at_draw is not None and self._draws >= p.at_draw):
            old, self._split, self._pending = self._split, list(p.sizes), None
            if old != self._split:
                _log.info("rank %d: new split %s (was %s)", self.rank, self._split, old)
                self._split_listeners(old, list(self._split))

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
        # Pad the last step so that every rank gets its minimum batch.
        remainder = max(remainder, self.min_batch_size * self.num_replicas)
        return full, proportional_split(remainder, split, caps=split, minimum=self.min_batch_size)

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

    def _first_step(self) -> int:
        """Where this epoch starts: 0, or the step saved by :meth:`state_dict`."""
        resume, self._resume_step = self._resume_step, None
        if resume is not None and resume[0] == self.epoch:
            return resume[1]
        return 0

    def __iter__(self) -> Iterator[int]:
        before = list(self._split)
        self._apply_pending(at_epoch_start=True)
        if self._split != before and not self._batch_mode:
            _log.warning(
                "rank %d: the split changed to %s; a DataLoader built with "
                "batch_size=%d must be rebuilt (or use batch_sampler=sampler.batch_sampler())",
                self.rank, self._split, before[self.rank],
            )
        perm = self._permutation()
        full, rest = self._layout()
        split = list(self._split)
        first = self._first_step()
        loader = _calling_batch_sampler()
        if loader is not None and loader.batch_size != split[self.rank]:
            raise SplitError(
                f"rank {self.rank}: DataLoader(batch_size={loader.batch_size}, sampler=kaitian sampler) "
                f"but kaitian's split {split} gives this rank {split[self.rank]} samples per step, so "
                "ranks would run different numbers of steps; use "
                "DataLoader(ds, batch_sampler=sampler.batch_sampler()) (follows re-balancing) or "
                "DataLoader(ds, batch_size=sampler.local_batch_size, sampler=sampler)"
            )
        for step in range(first, full + (1 if rest else 0)):
            self._epoch_step = step + 1
            indices = self._step_indices(perm, step, full, rest, split)
            self.last_batch_size = len(indices)
            yield from indices

    def epoch_batches(self) -> Iterator[List[int]]:
        """This rank's batches for the current epoch, following split changes."""
        self._apply_pending(at_epoch_start=True)
        perm = self._permutation()
        full, _ = self._layout()
        for step in range(self._first_step(), self.num_steps):
            self._apply_pending(at_epoch_start=False)
            split = list(self._split)
            _, rest = self._layout(split)
            self._draws += 1
            self._epoch_step = step + 1
            indices = self._step_indices(perm, step, full, rest, split)
            self.last_batch_size = len(indices)
            yield indices

    def batch_sampler(self) -> "KaitianBatchSampler":
        """A batch sampler for ``DataLoader(ds, batch_sampler=...)`` that follows the split."""
        return KaitianBatchSampler(self)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (reshuffles with ``seed + epoch``); call it before each epoch."""
        self.epoch = int(epoch)
        self._epoch_step = 0
        self._epoch_listeners(self.epoch)

    def add_epoch_hook(self, callback) -> None:
        """Calls ``callback(epoch)`` from :meth:`set_epoch` (used by the re-balancer)."""
        self._epoch_listeners.add(callback)

    # -- checkpoints ----------------------------------------------------------------

    def state_dict(self, step: Optional[int] = None) -> Dict[str, Any]:
        """Where this sampler is, the same on every rank: epoch, step in it, split.

        Args:
            step: batches of the current epoch already trained. Default: the
                batches handed out so far, right with ``num_workers=0``; a
                DataLoader with workers draws ahead, so pass the trained count.
        """
        pending = None
        if self._pending is not None:
            at = self._pending.at_draw
            pending = [list(self._pending.sizes), None if at is None else max(0, at - self._draws)]
        return {
            "epoch": self.epoch,
            "step": self._epoch_step if step is None else int(step),
            "split": list(self._split),
            "pending": pending,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`: the next epoch's iteration starts at the saved step.

        Raises:
            SplitError: the checkpoint is from a job with another world size or global batch.
        """
        if int(state["num_replicas"]) != self.num_replicas or int(state["global_batch_size"]) != self.global_batch_size:
            raise SplitError(
                f"checkpoint of {state['num_replicas']} ranks with global batch {state['global_batch_size']} "
                f"cannot resume {self.num_replicas} ranks with global batch {self.global_batch_size}"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._split = [int(s) for s in state["split"]]
        pending = state.get("pending")
        self._pending = None if not pending else _Pending(
            [int(s) for s in pending[0]], None if pending[1] is None else self._draws + int(pending[1])
        )
        self._resume_step = (self.epoch, int(state["step"]))
        self._epoch_step = int(state["step"])

    def state(self) -> Dict[str, object]:
        """A summary for logs: rank, split, capabilities, steps."""
        return {
            "rank": self.rank,
            "split": self.split,
            "capabilities": list(self.capabilities),
            "steps": self.num_steps,
        }


class KaitianBatchSampler(torch.utils.data.BatchSampler):
    """Yields this rank's index lists step by step, reading the split as it goes.

    A ``BatchSampler`` (what trainers expect after ``batch_sampler=``), driven
    by a :class:`DistributedSampler`.
    """

    def __init__(self, sampler: DistributedSampler) -> None:  # torch's __init__ checks a fixed size
        sampler._batch_mode = True
        self.sampler = sampler
        self.drop_last = sampler.drop_last

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        """This rank's batch under the current split."""
        return self.sampler.local_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        return self.sampler.epoch_batches()

    def __len__(self) -> int:
        return self.sampler.num_steps


def kaitian_sampler_of(loader) -> Optional[DistributedSampler]:
    """The :class:`DistributedSampler` behind a DataLoader (``sampler=`` or ``batch_sampler=``), or ``None``."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, KaitianBatchSampler):
        return batch_sampler.sampler
    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, DistributedSampler) else None


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
    s = latest_sampler()
    if s is not None and s.batch_size == int(batch_size):
        return s.local_batch_size
    if s is None and _latest_local is not None and _latest_local[0] == int(batch_size):
        return _latest_local[1]
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized:
        return int(batch_size)
    world = dist.get_world_size()
    caps = _fill_unknown(gather_capabilities(settings().capability))
    return proportional_split(int(batch_size) * world, caps)[dist.get_rank()]
