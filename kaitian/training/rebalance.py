"""Online re-balancing: move samples from slow ranks to fast ones while training.

The static split comes from ``kaitian init``'s benchmark, which may not match
the real model (or the machine may be busy, or get busy mid-run).
:class:`Rebalancer` watches each rank's measured *time per sample*: by default
its busy time per step (the step minus every collective wait: the gradient
allreduce, DDP's buffer broadcast, the re-balancing rounds themselves), or
forward + backward only (``measure="compute"``); device time on accelerators
(:mod:`kaitian.training.clock`). It smooths it with an exponential moving
average and, every ``every`` steps or ``seconds`` seconds (whichever comes
first; rank 0's clock decides, through the step's count exchange, so all
ranks agree), splits the global batch in proportion to each rank's speed,
capped by each rank's maximum batch. All ranks exchange their measurements
and compute the same new split from bit-identical inputs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch.distributed as dist

from kaitian.errors import SplitError
from kaitian.training.exchange import gather_per_rank
from kaitian.training.sampler import DistributedSampler
from kaitian.training.split import plan_split

__all__ = ["Rebalancer", "RebalanceDecision", "DEFAULT_EVERY", "DEFAULT_SECONDS"]

DEFAULT_EVERY = 25  # steps between re-balancing rounds ...
DEFAULT_SECONDS = 10.0  # ... or seconds, whichever comes first

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


class Rebalancer:
    """Re-splits a :class:`kaitian.DistributedSampler` from measured compute speed.

    Create it on every rank after the sampler and the model::

        sampler = kaitian.DistributedSampler(ds, batch_size=64)
        model = kaitian.DistributedDataParallel(net)
        kaitian.Rebalancer(sampler, model)      # every 25 steps or 10 s
        loader = DataLoader(ds, batch_sampler=sampler.batch_sampler())

    Args:
        sampler: the sampler whose split is changed.
        model: the :class:`kaitian.DistributedDataParallel` whose step timings
            are measured; it trains on ``sampler`` from now on
            (:meth:`~kaitian.DistributedDataParallel.use_sampler`).
        every: steps between rounds (default :data:`DEFAULT_EVERY`; ``1`` =
            every step); a change takes effect from the next batch drawn (use
            the sampler's ``batch_sampler()``; with DataLoader workers, batches
            already prefetched keep the old size). ``"epoch"``: only in
            ``sampler.set_epoch``, from that epoch on.
        seconds: also start a round when this many seconds passed since the
            last one (default :data:`DEFAULT_SECONDS`; ``0`` = off). Rank 0's
            clock decides.
        smoothing: EMA weight of the newest measurement (1 = no smoothing).
        max_batch_size: this rank's largest batch (an int; ranks may pass
            different values, e.g. from their device memory), or a sequence
            with one entry per rank. ``None`` = no cap.
        min_gain: change the split only if the slowest rank's predicted compute
            time drops by more than this fraction.
        warmup_steps: steps ignored after each split change (allocator and
            cache warm-up distort them) and at the start of each epoch.
        measure: ``"busy"`` (default): a rank's time per step minus all its
            collective waits - forward, backward, optimizer and data loading,
            the rank's whole share of the step; ``"compute"``: forward +
            backward only.
        group: the process group (default: the model's).

    Raises:
        TypeError: ``model`` is not a :class:`kaitian.DistributedDataParallel`.
        ValueError: a setting is out of range.
    """

    def __init__(
        self,
        sampler: DistributedSampler,
        model,
        every: Union[int, str, None] = None,
        seconds: Optional[float] = None,
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
        by_epoch = every == "epoch"
        if not by_epoch and every is not None and (isinstance(every, str) or int(every) < 1):
            raise ValueError(f"every must be a positive number of steps or 'epoch', got {every!r}")
        if seconds is not None and float(seconds) < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if measure not in ("busy", "compute"):
            raise ValueError(f"measure must be 'busy' or 'compute', got {measure!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.sampler = sampler
        self.every = None if by_epoch else (DEFAULT_EVERY if every is None else int(every))
        self.seconds = 0.0 if by_epoch else (DEFAULT_SECONDS if seconds is None else float(seconds))
        self.smoothing = float(smoothing)
        self.min_gain = float(min_gain)
        self.warmup_steps = int(warmup_steps)
        self.measure = measure
        self.world = sampler.num_replicas
        self._own_cap, self._caps = self._parse_caps(max_batch_size)
        self._ema: Optional[float] = None
        self._window_compute = 0.0
        self._window_samples = 0
        self._skip = self.warmup_steps
        self._step = 0
        self._last_round = time.monotonic()
        self.history: List[RebalanceDecision] = []
        self._attach(model, group)
        sampler.add_split_listener(self._on_split_change)
        sampler.add_epoch_hook(self._on_epoch)

    def _attach(self, model, group: Optional[dist.ProcessGroup] = None) -> None:
        """Measures ``model``'s steps and runs the rounds in its process group; ``model`` trains on the sampler."""
        model.use_sampler(self.sampler)
        self._device = model.device
        self.group = group if group is not None else model.process_group
        self._recorder = model.recorder
        # The model keeps the re-balancer alive through its listeners; the
        # re-balancer holds no reference to the model (no cycle to outlive the
        # process group).
        model.add_step_listener(self._on_step)
        if self.every is not None:
            model.add_before_step(self._on_before_step)
            if self.seconds > 0:
                model.set_round_vote(self._time_for_round)

    def rebind(self, model) -> None:
        """Follows a re-formed job (:mod:`kaitian.elastic`): ``model`` is the new
        :class:`kaitian.DistributedDataParallel`, the sampler already has the new world.

        This rank's smoothed measurement and the history are kept; a per-rank
        list of ``max_batch_size`` no longer matches the ranks and is dropped.
        """
        self.world = self.sampler.num_replicas
        if self._caps is not None and len(self._caps) != self.world:
            _log.warning("re-balancer: the per-rank max_batch_size list does not match the new world; dropped")
            self._caps = None
        self._window_compute, self._window_samples = 0.0, 0
        self._skip = self.warmup_steps
        self._step = 0
        self._attach(model)

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
        if self.measure == "compute":
            spent = timing.compute_s
        else:
            spent = timing.step_s - timing.comm_s - timing.wait_s
        if timing.samples > 0 and spent > 0:
            self._window_compute += spent
            self._window_samples += timing.samples

    def _on_split_change(self, old, new) -> None:
        # Batches of the old size may still be in flight when a mid-epoch change
        # is applied; skipping a few steps keeps them out of the next window.
        self._skip = self.warmup_steps

    @property
    def per_sample_s(self) -> Optional[float]:
        """This rank's smoothed compute seconds per sample, ``None`` before any measurement."""
        return self._ema

    # -- triggers ---------------------------------------------------------------------

    def _time_for_round(self) -> bool:
        """Rank 0's vote, carried by the step's count exchange."""
        return time.monotonic() - self._last_round >= self.seconds

    def _on_epoch(self, epoch: int) -> None:
        if self.every is None and self._step > 0:
            self.rebalance(after_draws=None)
        # The first step of an epoch also times what ran between epochs.
        self._skip = max(self._skip, self.warmup_steps)

    def _on_before_step(self, step: int, round_requested: bool = False) -> None:
        if step > 0 and (step % self.every == 0 or round_requested):
            self.rebalance(after_draws=0)

    # -- the round --------------------------------------------------------------------

    def rebalance(self, after_draws: Optional[int] = None) -> RebalanceDecision:
        """One re-balancing round; a collective, call it on every rank at the same point.

        Called for you every ``every`` steps / ``seconds`` seconds, or from
        ``set_epoch`` with ``every="epoch"``. A round without new measurements
        on some rank keeps the split.

        Args:
            after_draws: passed to :meth:`DistributedSampler.set_split`.

        Returns:
            The decision, also appended to :attr:`history`.
        """
        self._last_round = time.monotonic()
        fresh = self._window_samples > 0
        if fresh:
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
                new = plan_split(self.sampler.global_batch_size, per_sample, old, caps,
                                 self.min_gain, self.sampler.min_batch_size)
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
        if self._recorder is not None:
            self._recorder.record_rebalance(decision)
        _log.info(
            "rebalance at step %d: per-sample compute %s -> split %s%s",
            decision.step, ["%.3g" % t for t in per_sample], new, "" if applied else " (kept)",
        )
        return decision

    def _exchange(self):
        """All ranks' smoothed times and caps, bit-identical on every rank."""
        own = [float(self._ema) if self._ema is not None else 0.0,
               float(self._own_cap) if self._own_cap is not None else 0.0]
        table = gather_per_rank(own, self.group, self._device)
        per_sample = [row[0] for row in table]
        if self._caps is not None:
            caps = [None if c is None else int(c) for c in self._caps]
        else:
            caps = [int(row[1]) if row[1] > 0 else None for row in table]
        return per_sample, caps

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The measurements of every rank (a collective: call it on every rank).

        The same on every rank, so a ``torch.distributed.checkpoint`` keeps one copy.
        """
        per_sample, _ = self._exchange()
        return {"per_sample_s": per_sample, "step": self._step, "world": self.world}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`: this rank's smoothed time per sample comes back."""
        if int(state["world"]) != self.world:
            raise ValueError(f"re-balancer state of {state['world']} ranks cannot resume {self.world}")
        value = float(state["per_sample_s"][self.sampler.rank])
        self._ema = value if value > 0 else None
        self._step = int(state["step"])
        self._window_compute, self._window_samples = 0.0, 0
        self._skip = self.warmup_steps
