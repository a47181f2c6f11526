"""Online re-balancing: move samples from slow ranks to fast ones while training.

The static split comes from ``kaitian init``'s benchmark, which may not match
the real model (or the machine may be busy). :class:`Rebalancer` watches each
rank's measured *time per sample*: by default its busy time per step (the step
minus the time it waited for the gradient allreduce: forward, backward,
optimizer, data), or forward + backward only (``measure="compute"``); never the
time spent waiting in collectives (see :mod:`kaitian.training.ddp`). It smooths it
with an exponential moving average, and, between epochs (or every ``every`` steps),
splits the global batch in proportion to each rank's speed, capped by each
rank's maximum batch. All ranks exchange their measurements through the
process group and compute the same new split from bit-identical inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from kaitian.training.sampler import DistributedSampler, SplitError, proportional_split

__all__ = ["Rebalancer", "RebalanceDecision", "plan_split"]

_log = logging.getLogger(__name__)


@dataclass
class RebalanceDecision:
    """One re-balancing round, the same on every rank.

    Attributes:
        step: synchronised steps done when it was decided.
        epoch: the sampler's epoch at that point.
        per_sample_s: smoothed compute seconds per sample, per rank.
        old: the split before.
        new: the split after (equal to ``old`` when it was not worth changing).
        applied: whether ``new`` was handed to the sampler.
    """

    step: int
    epoch: int
    per_sample_s: List[float]
    old: List[int]
    new: List[int]
    applied: bool


def plan_split(
    global_batch: int,
    per_sample_s: Sequence[float],
    current: Sequence[int],
    caps: Optional[Sequence[Optional[int]]] = None,
    min_gain: float = 0.03,
) -> List[int]:
    """The split that equalises compute time, or ``current`` if the gain is too small.

    Args:
        global_batch: samples per step over all ranks.
        per_sample_s: each rank's compute seconds per sample (> 0).
        current: the split in use.
        caps: per-rank maximum batch (``None`` = no cap).
        min_gain: keep ``current`` unless the predicted slowest-rank compute
            time drops by more than this fraction (stops jitter from noise).

    Returns:
        The split to use.
    """
    speeds = [1.0 / t for t in per_sample_s]
    candidate = proportional_split(global_batch, speeds, caps=caps)

    def slowest(split: Sequence[int]) -> float:
        return max(b * t for b, t in zip(split, per_sample_s))

    if list(candidate) == list(current):
        return list(current)
    if slowest(candidate) < slowest(current) * (1.0 - min_gain):
        return candidate
    return list(current)


class Rebalancer:
    """Re-splits a :class:`kaitian.DistributedSampler` from measured compute speed.

    Create it on every rank after the sampler and the model::

        sampler = kaitian.DistributedSampler(ds, batch_size=64)
        model = kaitian.DistributedDataParallel(net)
        kaitian.Rebalancer(sampler, model)              # between epochs
        loader = DataLoader(ds, batch_sampler=sampler.batch_sampler())

    Args:
        sampler: the sampler whose split is changed.
        model: the :class:`kaitian.DistributedDataParallel` whose step timings
            are measured.
        every: ``None`` re-balances in ``sampler.set_epoch`` (the new split is
            used from that epoch); an integer ``K`` re-balances every ``K``
            steps, effective from the next batch drawn (use the sampler's
            ``batch_sampler()`` with ``num_workers=0`` for that mode, so all
            ranks draw batches at the same point).
        smoothing: EMA weight of the newest measurement (1 = no smoothing).
        max_batch_size: this rank's largest batch (an int; ranks may pass
            different values, e.g. from their device memory), or a sequence
            with one entry per rank. ``None`` = no cap.
        min_gain: change the split only if the slowest rank's predicted compute
            time drops by more than this fraction.
        warmup_steps: steps ignored after each split change (allocator and
            cache warm-up distort them) and at the start of each epoch.
        measure: ``"busy"`` (default): a rank's time per step minus the time
            it waited for the gradient allreduce - forward, backward,
            optimizer and data loading, the rank's whole share of the step;
            ``"compute"``: forward + backward only (first forward until the
            last gradient bucket is ready).
        group: the process group (default: the model's).

    Raises:
        TypeError: ``model`` is not a :class:`kaitian.DistributedDataParallel`.
        ValueError: a setting is out of range.
    """

    def __init__(
        self,
        sampler: DistributedSampler,
        model,
        every: Optional[int] = None,
        smoothing: float = 0.5,
        max_batch_size: Optional[Union[int, Sequence[Optional[int]]]] = None,
        min_gain: float = 0.03,
        warmup_steps: int = 1,
        measure: str = "busy",
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        from kaitian.training.ddp import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                "Rebalancer needs the model wrapped in kaitian.DistributedDataParallel "
                "(it measures the per-step compute time)"
            )
        if every is not None and int(every) < 1:
            raise ValueError(f"every must be a positive number of steps, got {every}")
        if measure not in ("busy", "compute"):
            raise ValueError(f"measure must be 'busy' or 'compute', got {measure!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.sampler = sampler
        self._device = model._kt_device
        self.every = None if every is None else int(every)
        self.smoothing = float(smoothing)
        self.min_gain = float(min_gain)
        self.warmup_steps = int(warmup_steps)
        self.measure = measure
        self.group = group if group is not None else model.process_group
        self.world = sampler.num_replicas
        self._own_cap, self._caps = self._parse_caps(max_batch_size)
        self._ema: Optional[float] = None
        self._window_compute = 0.0
        self._window_samples = 0
        self._skip = self.warmup_steps
        self._step = 0
        self.history: List[RebalanceDecision] = []
        # The model keeps the re-balancer alive; the re-balancer holds no
        # reference to the model (no cycle to outlive the process group).
        model._kt_keep_alive.append(self)
        model.add_step_listener(self._on_step)
        sampler.add_split_listener(self._on_split_change)
        if self.every is None:
            sampler.add_epoch_hook(self._on_epoch)
        else:
            model.add_before_step(self._on_before_step)

    def _parse_caps(self, max_batch_size):
        if max_batch_size is None:
            return None, None
        if isinstance(max_batch_size, int):
            if max_batch_size < 1:
                raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
            return max_batch_size, None
        caps = list(max_batch_size)
        if len(caps) != self.world:
            raise ValueError(f"max_batch_size has {len(caps)} entries for {self.world} ranks")
        return None, caps

    # -- measurements ----------------------------------------------------------------

    def _on_step(self, timing) -> None:
        self._step = timing.step + 1
        if self._skip > 0:
            self._skip -= 1
            return
        spent = timing.compute_s if self.measure == "compute" else timing.step_s - timing.comm_s
        if timing.samples > 0 and spent > 0:
            self._window_compute += spent
            self._window_samples += timing.samples

    def _on_split_change(self, old, new) -> None:
        # Batches of the old size are still in flight when a mid-epoch change
        # is applied; skipping a few steps keeps them out of the next window.
        self._skip = self.warmup_steps

    @property
    def per_sample_s(self) -> Optional[float]:
        """This rank's smoothed compute seconds per sample, ``None`` before any measurement."""
        return self._ema

    # -- triggers ---------------------------------------------------------------------

    def _on_epoch(self, epoch: int) -> None:
        if self._step > 0:
            self.rebalance(after_draws=None)
        # The first step of an epoch also times what ran between epochs.
        self._skip = max(self._skip, self.warmup_steps)

    def _on_before_step(self, step: int) -> None:
        if step > 0 and step % self.every == 0:
            self.rebalance(after_draws=0)
            self._skip = max(self._skip, 1)  # this step's time includes the round

    # -- the round --------------------------------------------------------------------

    def rebalance(self, after_draws: Optional[int] = None) -> RebalanceDecision:
        """One re-balancing round; a collective, call it on every rank at the same point.

        Called for you from ``set_epoch`` or every ``every`` steps.

        Args:
            after_draws: passed to :meth:`DistributedSampler.set_split`.

        Returns:
            The decision, also appended to :attr:`history`.
        """
        if self._window_samples > 0:
            measured = self._window_compute / self._window_samples
            self._ema = (
                measured if self._ema is None
                else self.smoothing * measured + (1.0 - self.smoothing) * self._ema
            )
            self._window_compute, self._window_samples = 0.0, 0
        per_sample, caps = self._exchange()
        old = self.sampler.split
        new, applied = list(old), False
        if all(t > 0 for t in per_sample):
            try:
                new = plan_split(self.sampler.global_batch_size, per_sample, old, caps, self.min_gain)
            except SplitError as exc:
                _log.warning("re-balancing skipped: %s", exc)
            if new != old:
                self.sampler.set_split(new, after_draws=after_draws)
                applied = True
        decision = RebalanceDecision(
            step=self._step, epoch=self.sampler.epoch, per_sample_s=per_sample,
            old=old, new=new, applied=applied,
        )
        self.history.append(decision)
        _log.info(
            "rebalance at step %d: per-sample compute %s -> split %s%s",
            decision.step, ["%.3g" % t for t in per_sample], new, "" if applied else " (kept)",
        )
        return decision

    def _exchange(self):
        """All ranks' smoothed times and caps; bit-identical on every rank (x + 0 is exact)."""
        rank = self.sampler.rank
        slots = torch.zeros(2 * self.world, dtype=torch.float32, device=self._device)
        slots[rank] = float(self._ema) if self._ema is not None else 0.0
        if self._own_cap is not None:
            slots[self.world + rank] = float(self._own_cap)
        if self.world > 1:
            dist.all_reduce(slots, group=self.group)
        values = slots.cpu().tolist()
        per_sample = values[: self.world]
        if self._caps is not None:
            caps = [None if c is None else int(c) for c in self._caps]
        else:
            caps = [int(c) if c > 0 else None for c in values[self.world:]]
        return per_sample, caps
