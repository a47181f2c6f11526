"""A distributed sampler whose per-rank batch follows each device's speed.

The global batch (``batch_size`` x world size, as with torch's sampler) is cut
across ranks in proportion to their capability, so every rank takes about the
same time per step. Every rank runs the same steps, every sample is used once
per epoch::

    permutation(seed + epoch) -> [ step 0: b_0 | b_1 | ... ][ step 1 ] ... [ last ]

``N // B`` full steps of the global batch ``B``, then one short step with the
``N % B`` rest split in proportion (each rank at least ``min_batch_size``; if
too few samples remain, the first of the permutation are repeated: at most
``W x min_batch_size - 1``). ``drop_last=True`` drops the short step instead.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.utils.data

from kaitian.errors import SplitError, TrainingError
from kaitian.training.listeners import Listeners
from kaitian.training.split import Capabilities, SplitSchedule, epoch_layout, proportional_split, rank_capabilities

__all__ = ["DistributedSampler", "KaitianBatchSampler", "HandedBatch", "kaitian_sampler_of", "SplitError",
           "DEFAULT_BATCH_SIZE"]

_log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32  # per rank of an equal split, when batch_size is not given


class HandedBatch(NamedTuple):
    """A batch this rank's sampler handed out: its step in the epoch and its size."""

    step: int
    size: int


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's ``DistributedSampler`` with per-rank batches in proportion to each device's speed.

    torch's subclass and constructor (so Lightning and Accelerate recognise it
    and do not shard again), plus ``batch_size``: the per-rank batch of an
    equal split; the global batch is ``batch_size * num_replicas``. Use it
    either way:

    * adaptive (recommended): ``DataLoader(ds, batch_sampler=sampler.batch_sampler())``
      follows split changes, also within an epoch;
    * classic: ``DataLoader(ds, batch_size=sampler.local_batch_size, sampler=sampler)``;
      the split is fixed while that loader lives, and a ``batch_size`` that
      is not this rank's share is refused at the first step.

    Args:
        dataset, num_replicas, rank, shuffle, seed, drop_last: as torch's
            (``drop_last`` drops the short last step instead of splitting it).
        batch_size: per-rank batch of an equal split (default :data:`DEFAULT_BATCH_SIZE`).
        capabilities: samples/s per rank (sequence or ``{rank: value}``).
            Default: each rank's ``KAITIAN_CAPABILITY`` (``kaitian init``),
            exchanged through ``group``; equal when unknown.
        group: process group used to exchange capabilities.
        min_batch_size: the smallest batch any rank gets in any step, the
            short last one included (BatchNorm needs 2; kaitian's DDP raises it).

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
        capabilities: Optional[Capabilities] = None,
        group: Optional[dist.ProcessGroup] = None,
        min_batch_size: int = 1,
    ) -> None:
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
        min_batch_size = int(min_batch_size)
        if not 1 <= min_batch_size <= batch_size:
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
        self.global_batch_size = self.batch_size * self.num_replicas
        self.capabilities = rank_capabilities(self.num_replicas, capabilities, group)
        self._schedule = SplitSchedule(
            proportional_split(self.global_batch_size, self.capabilities, minimum=min_batch_size), min_batch_size)
        self._epoch_step = 0  # batches handed out in the current epoch
        self._resume_step: Optional[Tuple[int, int]] = None  # (epoch, step) from load_state_dict
        self.first_step = 0  # where the current epoch's iteration started: 0, or a checkpoint's step
        self.yielded = 0  # indices iter(self) handed out this epoch: what a DataLoader's own batch_size took
        self._perm: Optional[tuple] = None  # ((len, shuffle, seed, epoch), permutation)
        # Batches handed out that no loss has claimed yet, oldest first: loaders
        # draw ahead (workers, Accelerate's look-ahead), so "the last" is not the trained one.
        self._unclaimed: Deque[HandedBatch] = deque()
        self._epoch_listeners = Listeners()
        self._spare_listeners = Listeners()
        _log.info("rank %d: global batch %d split %s (capabilities %s)",
                  self.rank, self.global_batch_size, self.split, self.capabilities)

    # -- the split ------------------------------------------------------------------

    @property
    def split(self) -> List[int]:
        """The current per-rank batch sizes (sum = global batch)."""
        return list(self._schedule.current)

    @property
    def local_batch_size(self) -> int:
        """This rank's batch per step under the current split."""
        return self._schedule.current[self.rank]

    @property
    def min_batch_size(self) -> int:
        """The smallest batch any rank gets in any step."""
        return self._schedule.minimum

    @property
    def benching(self) -> bool:
        """Whether a rank may get no samples (a benched rank: see :meth:`enable_benching`)."""
        return self._schedule.benching

    @property
    def resuming(self) -> bool:
        """Whether the coming pass continues a checkpoint's epoch (:meth:`load_state_dict`, then
        :meth:`set_epoch` of that epoch)."""
        return self._resume_step is not None and self._resume_step[0] == self.epoch

    @property
    def split_at_pass_start(self) -> List[int]:
        """The split the coming pass starts with: a change still waiting is due at its start."""
        return self._schedule.at_epoch_start

    def enable_benching(self) -> None:
        """Lets a split give a rank no samples; only for a caller that then takes that rank out of
        every per-step collective (:class:`kaitian.Rebalancer` with the optimizer does)."""
        self._schedule.benching = True

    def require_min_batch_size(self, minimum: int) -> None:
        """Raises :attr:`min_batch_size` (e.g. to 2 for BatchNorm), re-splitting if a rank is below it;
        call it alike on every rank."""
        self._schedule.raise_minimum(int(minimum))

    def set_split(self, batch_sizes: Sequence[int], after_draws: Optional[int] = None) -> None:
        """Changes the per-rank batch sizes; call it with the same values on every rank.

        Args:
            batch_sizes: one size per rank, each at least :attr:`min_batch_size`,
                adding up to the global batch (so the steps per epoch stay).
            after_draws: ``None``: from the next epoch (next ``__iter__``). ``k``:
                the batch sampler applies it after ``k`` more batches (``0`` =
                the next one), at the same point of every rank's program.

        Raises:
            SplitError: wrong length, a size below the minimum, or the wrong sum.
        """
        self._schedule.change(batch_sizes, after_draws)

    def add_split_listener(self, callback) -> None:
        """Calls ``callback(old_split, new_split)`` whenever a new split takes effect."""
        self._schedule.listeners.add(callback)

    # -- the epoch ------------------------------------------------------------------

    def layout(self) -> Tuple[int, Optional[List[int]]]:
        """(full steps, per-rank sizes of the short last step or ``None``) under the current split."""
        return epoch_layout(len(self.dataset), self._schedule.current, self.min_batch_size, self.drop_last)

    def __len__(self) -> int:
        """Samples this rank yields in the epoch's pass (see :meth:`_pass_layout`)."""
        split, full, rest = self._pass_layout()
        return full * split[self.rank] + (rest[self.rank] if rest else 0)

    def _pass_layout(self) -> Tuple[List[int], int, Optional[List[int]]]:
        """The split of the epoch's pass and its :meth:`layout`: before its first draw, a change waiting
        for the epoch start (the re-balancer's round in ``set_epoch``) is in force already, so that
        ``len(loader)`` read before the loop counts the batches it will get."""
        split = self._schedule.at_epoch_start if self._epoch_step == 0 else self.split
        return (split, *epoch_layout(len(self.dataset), split, self.min_batch_size, self.drop_last))

    @property
    def num_samples(self) -> int:  # torch's attribute
        return len(self)

    @property
    def total_size(self) -> int:
        """Samples all ranks yield per epoch, padding included (torch's attribute)."""
        full, rest = self.layout()
        return full * self.global_batch_size + sum(rest or ())

    @property
    def last_step_padding(self) -> int:
        """Samples the last step repeats so that every rank has its minimum (0 without padding)."""
        return max(0, self.total_size - len(self.dataset))

    @property
    def num_steps(self) -> int:
        """Steps per epoch; the same on every rank."""
        full, rest = self.layout()
        return full + (1 if rest else 0)

    def _permutation(self) -> List[int]:
        key = (len(self.dataset), self.shuffle, self.seed, self.epoch)
        if self._perm is None or self._perm[0] != key:  # drawn step by step: one permutation per epoch
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = (key, torch.randperm(key[0], generator=g).tolist() if self.shuffle else list(range(key[0])))
        return self._perm[1]

    def _cut(self, step: int) -> List[int]:
        """This rank's indices of ``step`` of the current epoch under the current split."""
        full, rest = self.layout()
        sizes = self._schedule.current if step < full else rest
        start = step * self.global_batch_size + sum(sizes[: self.rank])
        perm = self._permutation()
        end = start + sizes[self.rank]
        # past the end it wraps round: the last step's padding
        indices = perm[start:end] if end <= len(perm) else [perm[i % len(perm)] for i in range(start, end)]
        self._epoch_step = step + 1
        if indices:  # a benched rank's empty draw is no batch
            self._unclaimed.append(HandedBatch(step, len(indices)))
        return indices

    def claim_batch(self) -> HandedBatch:
        """The oldest batch handed out this epoch that no loss has claimed yet (batches are trained
        in the order they are handed out, however far the loader draws ahead).

        :func:`kaitian.scale_loss` without ``count=`` claims one per call.

        Raises:
            TrainingError: every batch handed out this epoch is claimed already.
        """
        if not self._unclaimed:
            raise TrainingError(
                f"rank {self.rank}: a loss claims a batch of kaitian's sampler, but every batch it handed out "
                "this epoch is claimed already (one scale_loss(loss, sampler=...) per batch); "
                "pass count=len(batch)")
        return self._unclaimed.popleft()

    def step_samples(self, step: int) -> int:
        """Samples over all ranks in ``step`` of the current epoch (the global batch, less in the
        short last step); the same under any split."""
        full, rest = self.layout()
        return self.global_batch_size if step < full else sum(rest or ())

    def _epoch(self, follow_split: bool) -> Iterator[List[int]]:
        """The stepping loop: this rank's batches of the current epoch, from its first step;
        ``follow_split=False`` keeps the split for the epoch (a DataLoader's ``batch_size`` cannot follow)."""
        before = self.split
        self._schedule.before_batch(at_epoch_start=True, draw=False)
        if not follow_split and self.split != before:
            _log.warning("rank %d: the split changed to %s; a DataLoader built with batch_size=%d must be rebuilt "
                         "(or use batch_sampler=sampler.batch_sampler())", self.rank, self.split, before[self.rank])
        self.first_step = self._resume_step[1] if self.resuming else 0
        self._resume_step = None
        self.yielded = 0
        self._unclaimed.clear()  # a new pass over the epoch: what the last one left untrained is void
        for step in range(self.first_step, self.num_steps):
            indices = self.draw(step) if follow_split else self._cut(step)
            if not indices:  # benched (from the epoch's start or from this step): a hot spare, no batch
                self._spare_listeners(self.epoch)
                return
            yield indices

    def __iter__(self) -> Iterator[int]:
        """This rank's indices step after step, for ``DataLoader(ds, batch_size=local_batch_size, sampler=self)``."""
        for indices in self._epoch(follow_split=False):
            for index in indices:
                self.yielded += 1
                yield index

    def epoch_batches(self) -> Iterator[List[int]]:
        """This rank's batches for the current epoch, following split changes."""
        return self._epoch(follow_split=True)

    def draw(self, step: int) -> List[int]:
        """This rank's indices for ``step`` of the current epoch, as :meth:`batch_sampler` hands them out.

        A split change that is due takes effect first (at step 0 also one
        waiting for the epoch). Drawing a step again after :meth:`reshape`
        gives this rank's share of the same global batch under the new split.
        """
        self._schedule.before_batch(at_epoch_start=step == 0, draw=True)
        return self._cut(step)

    def reshape(self, num_replicas: int, rank: int, split: Sequence[int]) -> None:
        """Takes a new world of ``num_replicas`` ranks with the same global batch, also mid-epoch
        (:mod:`kaitian.elastic`); call it alike on every rank of the new world.

        The epoch, its permutation and the step are kept; ``split`` (one size
        per new rank) replaces the current split and any pending change.

        Raises:
            SplitError: ``split`` does not fit the new world or the global batch.
            ValueError: ``rank`` is out of range.
        """
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}]")
        self._schedule.replace(split, int(num_replicas))
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.capabilities = [float(s) for s in self.split]
        self.batch_size = max(1, self.global_batch_size // self.num_replicas)  # the equal split's, nominally
        self._unclaimed.clear()  # batches of the old world are drawn again in the new one

    def batch_sampler(self) -> "KaitianBatchSampler":
        """A batch sampler for ``DataLoader(ds, batch_sampler=...)`` that follows the split."""
        return KaitianBatchSampler(self)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (reshuffles with ``seed + epoch``); call it before each epoch."""
        self.epoch = int(epoch)
        self._epoch_step = 0
        self.first_step = 0  # a pass over it starts at its beginning (or at a checkpoint's step: _epoch)
        self._epoch_listeners(self.epoch)

    def add_spare_hook(self, callback) -> None:
        """Calls ``callback(epoch)`` where a benched rank's pass over an epoch would start (it gets
        no batch; the re-balancer keeps its copy of the model current there)."""
        self._spare_listeners.add(callback)

    def add_epoch_hook(self, callback) -> None:
        """Calls ``callback(epoch)`` from :meth:`set_epoch` (used by the re-balancer)."""
        self._epoch_listeners.add(callback)

    # -- checkpoints ----------------------------------------------------------------

    def state_dict(self, step: Optional[int] = None) -> Dict[str, Any]:
        """Where this sampler is, the same on every rank: epoch, step in it, split.

        Args:
            step: batches of the current epoch already trained. Default: those
                handed out so far, right with ``num_workers=0``; a DataLoader
                with workers draws ahead, so pass the trained count.
        """
        return {"epoch": self.epoch, "step": self._epoch_step if step is None else int(step), "seed": self.seed,
                "global_batch_size": self.global_batch_size, "num_replicas": self.num_replicas,
                **self._schedule.state_dict()}

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
        self._schedule.load_state_dict(state)
        self._epoch_step = int(state["step"])
        self._resume_step = (self.epoch, self._epoch_step)


class KaitianBatchSampler(torch.utils.data.BatchSampler):
    """A ``BatchSampler`` (what trainers expect after ``batch_sampler=``) that yields this rank's
    batches step by step, reading the :class:`DistributedSampler`'s split as it goes."""

    def __init__(self, sampler: DistributedSampler) -> None:  # torch's __init__ checks a fixed size
        self.sampler = sampler
        self.drop_last = sampler.drop_last

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        """This rank's batch under the current split."""
        return self.sampler.local_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        return self.sampler.epoch_batches()

    def __len__(self) -> int:
        split, full, rest = self.sampler._pass_layout()
        return full + (1 if rest else 0) if split[self.sampler.rank] > 0 else 0  # benched: none


def kaitian_sampler_of(loader) -> Optional[DistributedSampler]:
    """The :class:`DistributedSampler` behind a DataLoader (``sampler=`` or ``batch_sampler=``), or ``None``."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, KaitianBatchSampler):
        return batch_sampler.sampler
    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, DistributedSampler) else None
