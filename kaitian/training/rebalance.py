"""Online re-balancing: who trains and how many samples each, from measured step costs.

The static split comes from ``kaitian init``'s benchmark, which may not match
the real model (or the machine may be busy, or get busy mid-run).
:class:`Rebalancer` fits each rank's step cost ``t = a + b * n`` from its
measured steps (:mod:`kaitian.training.stepcost`): by default its busy time
per step (the step minus every collective wait: the gradient allreduce, DDP's
buffer broadcast, the re-balancing rounds themselves), or forward + backward
only (``measure="compute"``); device time on accelerators
(:mod:`kaitian.training.clock`). Every ``every`` steps or ``seconds`` seconds
(whichever comes first; rank 0's clock decides, through the step's count
exchange, so all ranks agree) the ranks exchange their fits and compute the
same new split from bit-identical inputs: the one with the smallest
predicted step, gradient exchange included.

Given the optimizer, it also decides who trains: a rank whose step does not
pay (its fixed cost, or the exchange it adds, outweighs the samples it would
take) is *benched*: it gets no batch, and the others exchange gradients among
themselves (:meth:`kaitian.DistributedDataParallel.train_in`), so it holds
nobody up. It stays a hot spare: after each epoch's last optimizer step the
first training rank sends it the model, the optimizer's state and ``state=``
objects, point to point and without waiting; at each epoch start it learns
the new split from that rank, with what the loop changed after that step (an
LR schedule's step), and it is called back when the model predicts that it
pays. A benched rank may wait a whole epoch for its next message,
longer than any op may take: each message is announced on the process
group's store first, and the spare posts its receive only then.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from kaitian import _torch as _te
from kaitian.backend.stripes import kaitian_backend
from kaitian.errors import SplitError, TrainingError
from kaitian.training.ddp import steps_beside
from kaitian.training.exchange import gather_per_rank
from kaitian.training.probe import probe_seconds
from kaitian.training.sampler import DistributedSampler
from kaitian.training.stepcost import (
    StepCost, StepCostFit, exchange_of, follow_exchange, halfway, predicted_step, solve_split,
)

__all__ = ["Rebalancer", "RebalanceDecision", "DEFAULT_EVERY", "DEFAULT_SECONDS"]

DEFAULT_EVERY = 25  # steps between re-balancing rounds ...
DEFAULT_SECONDS = 10.0  # ... or seconds, whichever comes first
_FIRST_ROUND = 4  # ... and a first round after this many steps: start-up converges fast

_log = logging.getLogger(__name__)

_SPARE_POLL_S = 0.05  # a benched rank looks for its next message this often
DEFAULT_PROBE_EVERY_S = 30.0  # ... and probes its own speed this often
_PROBE_CHANGE = 0.25  # two probes in a row this much faster (or slower) than the cost published: a new cost
_OWN_ROW = 7  # the fields of a rank's own row in a round's exchange (then the spares' published costs)


@dataclass
class RebalanceDecision:
    """One re-balancing round, the same on every rank.

    Attributes:
        step: synchronised steps done when it was decided.
        epoch: the sampler's epoch at that point.
        per_sample_s: each rank's fitted seconds per sample (``b``).
        old: the split before.
        new: the split after (equal to ``old`` when it was not worth changing;
            zeros: benched ranks).
        applied: whether ``new`` was handed to the sampler.
        fixed_s: each rank's fitted fixed seconds per step (``a``).
        exchange_s: the gradient exchange's time across vendor groups used in the prediction.
        within_s: per vendor group, the exchange's time among its ranks alone (as measured).
        groups: each rank's vendor group (the keys of ``within_s``).
        stripes: the trainers' stripe weights of the all_reduce across groups from this round on
            (in proportion to each one's host reduce speed; ``None``: even).
        predicted_s: the predicted step time of ``new``.
        measured_s: the mean step time measured since the last round (this rank's clock).
    """

    step: int
    epoch: int
    per_sample_s: List[float]
    old: List[int]
    new: List[int]
    applied: bool
    fixed_s: List[float] = field(default_factory=list)
    exchange_s: float = 0.0
    within_s: Dict[str, float] = field(default_factory=dict)
    groups: List[str] = field(default_factory=list)
    stripes: Optional[List[int]] = None
    predicted_s: float = 0.0
    measured_s: float = 0.0


def _check_max_batch_size(max_batch_size) -> None:
    if isinstance(max_batch_size, int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    elif max_batch_size is not None and any(c is not None and int(c) < 1 for c in max_batch_size):
        raise ValueError(f"max_batch_size must be at least 1 (or None) per rank, got {list(max_batch_size)}")


class Rebalancer:
    """Re-splits a :class:`kaitian.DistributedSampler` from measured step costs.

    Create it on every rank after the sampler, the model and the optimizer::

        sampler = kaitian.DistributedSampler(ds, batch_size=64)
        model = kaitian.DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        kaitian.Rebalancer(sampler, model, optimizer=optimizer)   # every 25 steps or 10 s
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
        smoothing: weight of the newest fit against the previous round's (default 1: the
            newest alone; each fit already spans the rank's last 48 steps).
        max_batch_size: this rank's largest batch (an int; ranks may pass
            different values, e.g. from their device memory), or a sequence
            with one entry per rank. ``None`` = no cap.
        min_gain: change the split only if the predicted step time drops by
            more than this fraction.
        warmup_steps: steps ignored after each split change (allocator and
            cache warm-up distort them) and at the start of each epoch.
        measure: ``"busy"`` (default): a rank's time per step minus all its
            collective waits - forward, backward, optimizer and data loading,
            the rank's whole share of the step; ``"compute"``: forward +
            backward only.
        group: the process group (default: the model's).
        optimizer: the optimizer stepping the model. Given, ranks whose step
            does not pay are benched at epoch starts (see the module
            docstring); a benched rank receives its state at the end of each
            pass (a loop that stops at a step count: :attr:`steps`, :meth:`finish`).
        state: more objects with ``state_dict()`` / ``load_state_dict()`` that
            change with the steps (LR schedulers stepped per batch, an AMP
            GradScaler, counters): a benched rank receives them with the
            optimizer's; an LR scheduler of ``optimizer`` must be among them.
        probe_every_s: a benched rank times a forward and backward of its last
            batch this often while it waits, and its step cost follows the
            probe's speed (``0``: never; see docs/training.md).

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
        smoothing: float = 1.0,
        max_batch_size: Optional[Union[int, Sequence[Optional[int]]]] = None,
        min_gain: float = 0.03,
        warmup_steps: int = 1,
        measure: str = "busy",
        group: Optional[dist.ProcessGroup] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        state: Sequence[Any] = (),
        probe_every_s: float = DEFAULT_PROBE_EVERY_S,
    ) -> None:
        from kaitian.training.ddp import DistributedDataParallel

        by_epoch = every == "epoch"
        if not by_epoch and every is not None and (isinstance(every, str) or int(every) < 1):
            raise ValueError(f"every must be a positive number of steps or 'epoch', got {every!r}")
        if seconds is not None and not float(seconds) >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if measure not in ("busy", "compute"):
            raise ValueError(f"measure must be 'busy' or 'compute', got {measure!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not 0.0 <= min_gain < 1.0:  # 1 or more: no split could ever gain enough
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not float(probe_every_s) >= 0:
            raise ValueError(f"probe_every_s must be >= 0, got {probe_every_s}")
        _check_max_batch_size(max_batch_size)
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                "Rebalancer needs the model wrapped in kaitian.DistributedDataParallel "
                "(it measures the per-step compute time)"
            )
        self.sampler = sampler
        self.every = None if by_epoch else (DEFAULT_EVERY if every is None else int(every))
        self.seconds = 0.0 if by_epoch else (DEFAULT_SECONDS if seconds is None else float(seconds))
        self.smoothing = float(smoothing)
        self.min_gain = float(min_gain)
        self.warmup_steps = int(warmup_steps)
        self.measure = measure
        self.world = sampler.num_replicas
        self.optimizer = optimizer
        self.state = list(state)
        self.probe_every_s = float(probe_every_s)
        self._own_cap, self._caps = self._parse_caps(max_batch_size)
        self._fit = StepCostFit()
        self._cost: Optional[StepCost] = None  # this rank's smoothed fit
        self._last_round = time.monotonic()
        # called while a benched rank waits for its next message; it may raise to end the wait
        # (kaitian.elastic: a training rank was lost)
        self.while_waiting: Optional[Callable[[], None]] = None
        self.history: List[RebalanceDecision] = []
        self._job_steps = 0  # the job's synchronised steps (steps)
        self._attach(model, group)
        self._vendor_groups = self._exchange_vendor_groups()
        self.bench_blocker = model.bench_blocker() if optimizer is not None else "no optimizer given"
        if optimizer is not None and self.bench_blocker is None:
            sampler.enable_benching()
            optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step())
            sampler.add_spare_hook(self._serve_as_spare)
        sampler.add_split_listener(self._on_split_change)
        sampler.add_epoch_hook(self._on_epoch)

    def _attach(self, model, group: Optional[dist.ProcessGroup] = None) -> None:
        """Measures ``model``'s steps and runs the rounds in its process group; ``model`` trains on the sampler.

        Everything counted in a group starts afresh, the same on every rank (a joiner's too):
        what decides whether a round may bench must agree.
        """
        self._comm = [0.0, 0]  # communication seconds and steps since the last round
        self._busy = [0.0, 0]  # step seconds and steps since the last round (the measured step)
        self._exchange_s = 0.0  # the exchange of training ranks in several vendor groups (follow_exchange)
        self._within_s: Dict[str, float] = {}  # ... and of ranks all in one group, per group
        self._skip = self.warmup_steps
        self._step = 0
        self._steps_done = 0  # synchronised steps this rank took part in
        # ... since the last round: the same on every training rank (a rank called back from the
        # bench took fewer steps than the others, so no count of its own steps can time the rounds)
        self._since_round = 0
        self._epoch_steps = 0  # ... in this epoch's pass
        self._one_micro = True  # every step so far was one batch (no accumulation; views of one batch count once)
        self._ddp_step = 0
        self._switch: Optional[Tuple[int, List[int]]] = None  # (step, ranks): the trainers' next group
        self._epoch_batches = 0  # batches this rank trained in this epoch's pass
        self._sync_due = False
        self._serve_after: Optional[int] = None  # a spare's last step handed out, drawn ahead of its training
        self._groups: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
        self._known = [StepCost(0.0, 0.0)] * self.world  # every rank's cost as of the last round it took part in
        self._known_caps: List[Optional[int]] = [None] * self.world
        self._sending: List[tuple] = []  # (works, tensors) sent to benched ranks: kept until they arrive
        self._snapshot: Optional[tuple] = None  # (buffer, its tensors' specs, works) of the last state sent
        self._received = 0  # messages this rank took as a benched rank (the store counts those sent to it)
        # benched: (its first probe's seconds, its cost then, the ratio published, the last probe's if off it)
        self._probe: Optional[Tuple[float, StepCost, float, Optional[float]]] = None
        self._next_probe = 0.0
        self._published = False  # this rank's cost key holds a probe's cost
        self._next_read = 0.0  # the first training rank reads the spares' published costs from then on
        model.use_sampler(self.sampler)
        self._steps_beside = steps_beside(model)  # the other models' steps so far (a stale one never grows)
        if self.optimizer is not None and self.probe_every_s > 0:  # a benched rank probes on them
            model.remember_inputs()
        self._device = model.device
        self.world_group = group if group is not None else model.process_group
        self._model_ref = weakref.ref(model)
        self._recorder = model.recorder
        # The model keeps the re-balancer alive through its listeners; the
        # re-balancer holds no reference to the model (no cycle to outlive the
        # process group).
        model.add_step_listener(self._on_step)
        model.add_step_end(self._on_step_end)
        if self.every is not None:
            model.add_before_step(self._on_before_step)
            if self.seconds > 0:
                model.set_round_vote(self._time_for_round)
        self._away = False  # the world group knows that spares are away from its collectives: they wait for
        self._trainers: List[int] = []  # ... these ranks' pass to end (a trainer's view, from _train_in)
        self._owed: Optional[int] = None  # a benched rank: the trainer that owes it its pass's end state

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of the training ranks (the rounds within an epoch run there); on a benched
        rank, a group of its own (from the optimizer step of the last batch it trained)."""
        model = self._model_ref()
        return model.training_group if model is not None else self.world_group

    @property
    def steps(self) -> int:
        """The job's synchronised steps so far, the same on every rank (a benched rank's comes with the
        state it receives): a loop that stops at a step count counts these, and ends with
        :meth:`finish`."""
        return self._job_steps

    def finish(self) -> None:
        """Ends training on this rank: call it on every rank after the training loops. A pass the
        trainers left within an epoch (a loop that stops at ``max_steps``) still owes the benched
        ranks its state, as an epoch's end would: the first trainer sends it, a benched rank takes it
        (where it waits, or here), and the sends in flight are delivered."""
        self._end_pass()
        self.wait_sent()

    def rebind(self, model) -> None:
        """Follows a re-formed job (:mod:`kaitian.elastic`): ``model`` is the new
        :class:`kaitian.DistributedDataParallel`, the sampler already has the new world.

        This rank's fit and the history are kept; a per-rank list of
        ``max_batch_size`` no longer matches the ranks and is dropped.
        """
        self.world = self.sampler.num_replicas
        if self._caps is not None and len(self._caps) != self.world:
            _log.warning("re-balancer: the per-rank max_batch_size list does not match the new world; dropped")
            self._caps = None
        self._attach(model)
        self._vendor_groups = self._exchange_vendor_groups()

    def _parse_caps(self, max_batch_size):
        if max_batch_size is None:
            return None, None
        if isinstance(max_batch_size, int):
            return max_batch_size, None
        caps = list(max_batch_size)
        if len(caps) != self.world:
            raise ValueError(f"max_batch_size has {len(caps)} entries for {self.world} ranks")
        return None, caps

    def _exchange_vendor_groups(self) -> List[str]:
        """Every rank's vendor group (``KAITIAN_GROUP``, else its device type), as a stable id."""
        from kaitian.settings import settings

        name = settings().group or self._device.type
        ids = [int(row[0]) for row in gather_per_rank([zlib.crc32(name.encode())], self.world_group, self._device)]
        return [f"group-{i}" for i in ids]

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
            self._fit.add(timing.samples, spent)
            self._comm[0] += timing.comm_s
            self._comm[1] += 1
            self._busy[0] += timing.step_s - timing.wait_s
            self._busy[1] += 1

    def _on_step_end(self, global_samples: int, batches: int) -> None:
        """Each synchronised step as it ends (timings may come a step later, on a device); ``batches``: this
        rank's backward passes in it (accumulated micro-batches; forwards of one pass are views of one batch)."""
        self._steps_done += 1
        self._job_steps += 1
        self._since_round += 1
        self._epoch_steps += 1
        self._one_micro = self._one_micro and batches == 1
        self._epoch_batches += batches
        if self.sampler.num_replicas > self.sampler.split.count(0) > 0:  # the epoch's last step: spares wait
            # counted in batches: every rank trains one a sampler step, whatever the split (two views of a
            # batch counted as samples ended the pass halfway, and the spares took a stale state)
            full, rest = self.sampler.layout()
            self._sync_due = self.sampler.first_step + self._epoch_batches >= full + (rest is not None)

    def _on_split_change(self, old, new) -> None:
        # Batches of the old size may still be in flight when a mid-epoch change
        # is applied; skipping a few steps keeps them out of the next window.
        self._skip = self.warmup_steps

    @property
    def per_sample_s(self) -> Optional[float]:
        """This rank's fitted seconds per sample, ``None`` before any measurement."""
        return self._cost.per_sample_s if self._cost is not None else None

    @property
    def step_cost(self) -> Optional[StepCost]:
        """This rank's fitted step cost (``a + b n``), ``None`` before any measurement."""
        return self._cost

    # -- triggers ---------------------------------------------------------------------

    def _time_for_round(self) -> bool:
        """Rank 0's vote, carried by the step's count exchange."""
        return time.monotonic() - self._last_round >= self.seconds

    @property
    def _steps_trained(self) -> int:
        """Steps of this epoch trained so far (those of an interrupted pass before ``first_step``)."""
        return self.sampler.first_step + self._epoch_steps

    def _ahead(self) -> int:
        """Batches this rank's loader has drawn beyond the one being trained."""
        return self.sampler.state_dict()["step"] - (self._steps_trained + 1)

    def _on_epoch(self, epoch: int) -> None:
        self._end_pass()  # a pass left within its epoch (a step limit per epoch) ends here
        self._epoch_batches, self._epoch_steps, self._sync_due, self._serve_after = 0, 0, False, None
        if self.sampler.resuming:
            # a checkpoint's epoch goes on under the checkpoint's split, on every rank alike: the
            # trainers exchange among themselves from its first step, a benched rank waits for its end
            self._switch = None
            self._train_in(_trainers(self.sampler.split_at_pass_start))
        elif self.sampler.local_batch_size == 0:
            self._follow_as_spare()
        elif self.sampler.benching and (self._steps_done >= 2 or self._spares()):
            # who trains this epoch (after two steps: torch's DDP has rebuilt its buckets then,
            # a collective of its whole group; at once where a resumed job has spares waiting for word)
            self.rebalance(after_draws=None, epoch_start=True)
        elif self.every is None and self._steps_done > 0:
            self.rebalance(after_draws=None)
        # The first step of an epoch also times what ran between epochs.
        self._skip = max(self._skip, self.warmup_steps)

    def _on_before_step(self, step: int, round_requested: bool = False) -> None:
        self._ddp_step = step
        if self._switch is not None and step >= self._switch[0]:
            self._apply_switch()
        if self._switch is not None:
            # a bench takes effect at a step set already; till then each rank's split changes at its
            # own draw of that step (loaders draw ahead by different amounts): no round, on any rank
            return
        if len(self._spares()) >= self.world - 1:
            return  # one rank trains: nothing to move within an epoch (a spare is called back at an epoch start)
        since = self._since_round
        first = since == _FIRST_ROUND and not self.history
        if since > 0 and (since >= self.every or round_requested or first):
            self.rebalance(after_draws=0)

    # -- the round --------------------------------------------------------------------

    def rebalance(self, after_draws: Optional[int] = None, epoch_start: bool = False) -> RebalanceDecision:
        """One re-balancing round; a collective, call it on every training rank at the same point.

        Called for you every ``every`` steps / ``seconds`` seconds, and at each
        epoch start when benching (the only round that calls a benched rank
        back: the first training rank then tells every benched rank the new
        split). A round without measurements on some training rank keeps the split.

        Args:
            after_draws: passed to :meth:`DistributedSampler.set_split`.
            epoch_start: the round in ``sampler.set_epoch``.

        Returns:
            The decision, also appended to :attr:`history`.
        """
        if self.sampler.benching:
            self._check_schedulers_travel()
            self._check_alone_in_its_group()
        self._last_round = time.monotonic()
        self._since_round = 0
        self._probe, self._next_probe = None, 0.0  # benched now, it probes afresh: its first probe is its cost now
        fit = self._fit.cost() if self._fit.points else None
        if fit is not None:
            old_cost = self._cost
            self._cost = fit if old_cost is None else StepCost(
                self.smoothing * fit.fixed_s + (1 - self.smoothing) * old_cost.fixed_s,
                self.smoothing * fit.per_sample_s + (1 - self.smoothing) * old_cost.per_sample_s)
        old = self.sampler.split
        training = _trainers(old)
        costs, comm, caps, measured, ahead, speeds = self._exchange(training, self.group, epoch_start)
        if comm is not None:
            self._keep_exchange(training, comm)
        # Benching: at an epoch start, or once an epoch between steps of whole batches (the
        # lead of the loaders that draw ahead is known) where the trainers can switch groups
        # within the epoch (a switch at its end is the epoch start's round's to make: that round
        # runs in the group every rank is still in); calling back only at an epoch start.
        switch_in_epoch = self._steps_trained + 1 + max(ahead) < self.sampler.num_steps
        bench = self.sampler.benching and self.bench_blocker is None and self._steps_done >= 2 and (
            epoch_start or (after_draws == 0 and self._one_micro and 0 not in old and switch_in_epoch))
        candidates = [r for r in range(self.world) if costs[r].known] if epoch_start else training
        new, applied, predicted = list(old), False, 0.0
        if all(costs[r].known for r in training):
            try:
                decision = solve_split(
                    self.sampler.global_batch_size, costs, self._vendor_groups, self._exchange_s, old,
                    self.sampler.min_batch_size, caps, allow_bench=bench, training=candidates,
                    within_s=self._within_s)
                predicted = decision.current_s
                if decision.predicted_s < decision.current_s * (1.0 - self.min_gain):
                    new, predicted = decision.split, decision.predicted_s
                    self._say_why(decision, old, costs)
            except SplitError as exc:
                _log.warning("re-balancing skipped: %s", exc)
        if self._reverses(old, new):
            new = halfway(old, new)
            predicted = predicted_step(new, costs, self._exchange_s, self._vendor_groups, self._within_s)
        staying = _trainers(new)
        if new != old and not epoch_start and staying != training:
            # Benched from the first batch no loader has drawn yet: the trainers change
            # groups at that step, the benched rank's pass over the epoch ends there.
            lead = max(ahead)
            self.sampler.set_split(new, after_draws=lead - self._ahead())
            self._switch = (self._ddp_step + 1 + lead, staying)
            me = dist.get_rank(self.world_group)
            self._group_of(staying if me in staying else [me])  # made now: the switch may come in a hook
            applied = True
        elif new != old or epoch_start:  # the epoch start's decision also replaces a change still waiting
            self.sampler.set_split(new, after_draws=after_draws)
            applied = new != old
        if epoch_start:
            self._switch = None
            self._tell_spares(old, new)
            self._train_in(staying)
        stripes = self._weigh_stripes(speeds) if staying == training else None
        decision_record = RebalanceDecision(
            step=self._step, epoch=self.sampler.epoch, per_sample_s=[c.per_sample_s for c in costs],
            old=old, new=new, applied=applied, fixed_s=[c.fixed_s for c in costs],
            exchange_s=self._exchange_s, within_s=dict(self._within_s), groups=list(self._vendor_groups),
            stripes=stripes, predicted_s=predicted, measured_s=measured,
        )
        self.history.append(decision_record)
        self._fit_window_done()
        if self._recorder is not None:
            self._recorder.record_rebalance(decision_record)
        _log.info(
            "rebalance at step %d: step cost %s, exchange %.3g s (within a group: %s) -> split %s%s "
            "(predicted %.3g s, measured %.3g s)",
            decision_record.step, ["%.3g+%.3g*n" % (c.fixed_s, c.per_sample_s) for c in costs],
            self._exchange_s, {g: float("%.3g" % t) for g, t in self._within_s.items()} or "not measured", new,
            "" if applied else " (kept)", predicted, measured,
        )
        return decision_record

    def _keep_exchange(self, training: List[int], comm: float) -> None:
        """The round's exchange time among ``training``, kept by kind (:func:`follow_exchange`)."""
        if len(training) < 2:
            return
        groups = {self._vendor_groups[r] for r in training}
        if len(groups) == 1:
            group = groups.pop()
            self._within_s[group] = follow_exchange(self._within_s.get(group), comm)
        else:
            self._exchange_s = follow_exchange(self._exchange_s, comm)

    def _reverses(self, old: List[int], new: List[int]) -> bool:
        """Whether ``new`` moves samples back the way the last round moved them, among the same
        trainers. Such a move goes halfway: the step's cost is not linear there (a step under a
        CPU quota jumps at the quota's period, a kernel at its tile size), and full moves back and
        forth would follow that edge for ever; halving converges onto it."""
        last = self.history[-1] if self.history else None
        if new == old or last is None or last.new != old:
            return False
        if not _trainers(last.old) == _trainers(old) == _trainers(new):
            return False
        return sum((now - before) * (after - now) for before, now, after in zip(last.old, old, new)) < 0

    def _weigh_stripes(self, speeds: List[float]) -> Optional[List[int]]:
        """The trainers' all_reduce across vendor groups gives each a stripe in proportion to its
        host reduce speed (``speeds``, exchanged in this round: the same weights on every trainer,
        set at the same point of their collectives); even stripes within one group or speeds alike."""
        group = self.group
        if len({self._vendor_groups[r] for r, n in enumerate(self.sampler.split) if n > 0}) < 2:
            return None
        try:
            from kaitian.backend.stripes import set_stripe_weights, weights_for

            weights = weights_for(speeds)
            set_stripe_weights(weights, group)
        except ValueError:  # not backend kaitian (torch's DDP over gloo, say): its reduction is its own
            return None
        return weights

    def _fit_window_done(self) -> None:
        self._comm, self._busy = [0.0, 0], [0.0, 0]

    def _exchange(self, ranks: List[int], group: dist.ProcessGroup, epoch_start: bool = False):
        """The round's exchange among ``ranks`` (the world ranks of ``group``, in its rank order):
        every rank's fitted cost (a benched rank's: its last, kept by every rank, or at an epoch start
        what its probe published, as the first of ``ranks`` read it), the exchange time, the caps,
        the measured step, the loaders' leads and the host reduce speeds, the same on every rank."""
        cost = self._cost if self._cost is not None else StepCost(0.0, 0.0)
        comm = self._comm[0] / self._comm[1] if self._comm[1] else -1.0
        busy = self._busy[0] / self._busy[1] if self._busy[1] else -1.0
        own = [cost.fixed_s, cost.per_sample_s, comm, busy,
               float(self._own_cap) if self._own_cap is not None else 0.0,
               self._ahead() if self.sampler.local_batch_size > 0 else 0.0, _reduce_speed(group)]
        first = dist.get_rank(self.world_group) == ranks[0]
        table = gather_per_rank(own + self._published_costs(epoch_start and first), group, self._device)
        caps: List[Optional[int]] = list(self._known_caps)
        for r, row in zip(ranks, table):
            self._known[r] = StepCost(row[0], row[1])
            caps[r] = int(row[4]) if row[4] > 0 else None
        self._known_caps = list(caps)
        published = table[0][_OWN_ROW:]
        for r in range(self.world):
            if r not in ranks and published[2 * r + 1] > 0:
                self._known[r] = StepCost(published[2 * r], published[2 * r + 1])
        costs = list(self._known)
        if self._caps is not None:
            caps = [None if c is None else int(c) for c in self._caps]
        # the rank that waited least in the exchange waited for nobody: its time is the exchange's
        comms = [row[2] for row in table if row[2] >= 0]
        steps = [row[3] for row in table if row[3] >= 0]
        ahead = [int(row[5]) for row in table]
        speeds = [row[6] for row in table]
        return costs, (min(comms) if comms else None), caps, (max(steps) if steps else 0.0), ahead, speeds

    def _say_why(self, decision, old: List[int], costs: List[StepCost]) -> None:
        """The first training rank logs each bench and call-back with its reason."""
        if dist.get_rank(self.world_group) != next(r for r, n in enumerate(old) if n > 0):
            return
        for r, (was, now) in enumerate(zip(old, decision.split)):
            if (was > 0) == (now > 0):
                continue
            with_it = [q for q, n in enumerate(old if now == 0 else decision.split) if n > 0]
            exchange = exchange_of(with_it, self._exchange_s, self._vendor_groups, self._within_s)
            why = (f"the step is predicted {1e3 * decision.predicted_s:.3g} ms "
                   f"{'without' if now == 0 else 'with'} it and {1e3 * decision.current_s:.3g} ms "
                   f"{'with' if now == 0 else 'without'} it (its step {1e3 * costs[r].fixed_s:.3g} ms + "
                   f"{1e3 * costs[r].per_sample_s:.3g} ms x samples, the exchange with it {1e3 * exchange:.3g} ms)")
            if now == 0:
                _log.warning("rank %d benched: %s; a hot spare, called back at an epoch start when it pays", r, why)
            else:
                _log.warning("rank %d called back with %d samples: %s", r, now, why)

    # -- benched ranks ----------------------------------------------------------------

    def _group_of(self, training: List[int]) -> dist.ProcessGroup:
        """The process group of ``training`` (made once per set, by its members alone)."""
        key = tuple(training)
        if len(key) == self.world:
            return self.world_group
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), use_local_synchronization=True)
        return self._groups[key]

    def _train_in(self, training: List[int]) -> None:
        """The model exchanges among ``training``, from its next step; a rank outside it is alone in a
        group of its own until it trains again, so that a collective in ``balancer.group`` (a logged
        loss) never waits for a spare."""
        model = self._model_ref()
        if model is None:
            return
        me = dist.get_rank(self.world_group)
        model.train_in(self._group_of(training if me in training else [me]))
        self._trainers, self._owed = list(training), (None if me in training else min(training))
        if me in training and len(training) < self.world:
            self._mark_spares_away([r for r in range(self.world) if r not in training])

    def _apply_switch(self) -> None:
        """A bench within the epoch takes effect: the ranks change groups."""
        staying, self._switch = self._switch[1], None
        self._train_in(staying)

    def _mark_spares_away(self, spares: List[int]) -> None:
        """Till the state reaches the spares at the epoch's end, a collective over every rank would wait
        for a spare: one called meanwhile fails at once, saying where to run it."""
        if not self._away:
            who = f"rank {spares[0]} is" if len(spares) == 1 else f"ranks {', '.join(map(str, spares))} are"
            self._set_away(f"{who} benched by kaitian.Rebalancer (a hot spare: in no collective until the "
                           "epoch's end), so this collective would wait for it; between steps, run collectives "
                           "in the training ranks' group, balancer.group")

    def _set_away(self, why: str) -> None:
        self._away = bool(why)
        try:
            kaitian_backend(self.world_group).set_away(why)
        except ValueError:  # not backend kaitian: such a collective waits for the group's timeout
            pass

    def _switch_if_due(self) -> None:
        """The last step the leaving rank trains is done: the rest of the loop body (a logged loss in
        balancer.group, say) runs in the new groups already, since a spare whose loader drew ahead waits
        for the epoch's end from here (:meth:`_after_optimizer_step`). A switch is due within its
        epoch (:meth:`rebalance`): a pass left before its step (a step limit) leaves it to the epoch
        start's round."""
        if self._switch is not None and self._ddp_step + 1 >= self._switch[0]:
            self._apply_switch()

    def _after_optimizer_step(self) -> None:
        self._switch_if_due()
        if self._sync_due:
            self._sync_due = False
            self._end_pass()
        if self._serve_after is not None and self._steps_trained >= self._serve_after:
            self.serve_epoch()

    def _end_pass(self) -> None:
        """This rank's pass over the epoch ends (at its last step, or where its loop was left): the
        spares waiting for the trainers' pass take the state from the first of them, and a spare still
        owed it takes it here. A loop that skipped that step's optimizer step (an AMP GradScaler's
        overflow) makes the switch here."""
        self._switch_if_due()
        if self._away:
            if dist.get_rank(self.world_group) == self._trainers[0]:
                self._send_state([r for r in range(self.world) if r not in self._trainers])
            self._set_away("")
        if self._owed is not None:
            self.serve_epoch()

    def _check_schedulers_travel(self) -> None:
        """A benched rank runs no optimizer step, so an LR scheduler it does not receive with the
        optimizer's state stands still there, and once called back the rank would step with another
        learning rate than the others: their weights silently apart. Checked at every round, before
        any bench, alike on every training rank."""
        if scheduler_left_out(self.optimizer, self.state):
            raise TrainingError(
                "kaitian.Rebalancer: the optimizer has an LR scheduler that state= does not hold; a benched rank "
                "runs no step, so its schedule would stand still and, called back, it would train with another "
                "learning rate: pass it, Rebalancer(..., optimizer=optimizer, state=[scheduler])")

    def _check_alone_in_its_group(self) -> None:
        """A benched rank leaves this model's exchange only: another kaitian DDP model that trains in its
        process group (a GAN's second network) would wait for it at its next step. From the first round
        that sees such a model take a step, no rank is benched (the same on every training rank: their
        models step alike)."""
        model = self._model_ref()
        if self.bench_blocker is not None or model is None:
            return
        if any(steps > self._steps_beside.get(key, 0) for key, steps in steps_beside(model).items()):
            self.bench_blocker = ("another kaitian.DistributedDataParallel model trains in its process group "
                                  "(a GAN's second network?)")
            _log.warning("re-balancer: %s, whose exchange a benched rank would leave: no rank is benched from "
                         "now on, the samples still move", self.bench_blocker)

    def _source(self) -> int:
        """The rank that tells the benched ones: the first that trains."""
        return next(r for r, n in enumerate(self.sampler.split) if n > 0)

    def _spares(self) -> List[int]:
        return [r for r, n in enumerate(self.sampler.split) if n == 0]

    def _tell_spares(self, old: List[int], new: List[int]) -> None:
        """At an epoch start, the first training rank sends each benched rank the new split (and the
        whole state to one called back: the trainers' steps are complete now, their last LR-schedule
        step included, which the end-of-epoch copy left before)."""
        source = next(r for r, n in enumerate(old) if n > 0)
        if dist.get_rank(self.world_group) != source:
            return
        spares = [r for r, n in enumerate(old) if n == 0]
        # the split, and what it was decided from: a rank called back decides with the others next
        within = [self._within_s.get(g, -1.0) for g in self._vendor_groups]
        message = torch.tensor([self.sampler.epoch, *new, *(c.fixed_s for c in self._known),
                                *(c.per_sample_s for c in self._known), *within, self._exchange_s],
                               dtype=torch.float64)
        self._send([message], spares)
        called_back = [r for r in spares if new[r] > 0]
        if called_back:
            self._send_state(called_back)
        benched = [r for r in spares if new[r] == 0]
        if benched:
            self._send_state(benched, after_step=True)

    def _follow_as_spare(self) -> None:
        """A benched rank at an epoch start: the first training rank's word on the new split."""
        source = self._source()
        world = self.world
        message = torch.empty(4 * world + 2, dtype=torch.float64)
        self._await_message(source)
        dist.recv(message, source, group=self.world_group)
        values = message.tolist()
        epoch, new = int(values[0]), [int(n) for n in values[1:world + 1]]
        if epoch != self.sampler.epoch or sum(new) != self.sampler.global_batch_size or min(new) < 0:
            raise TrainingError(f"re-balancer: rank {source} sent split {new} for epoch {epoch} to a benched rank "
                                f"at epoch {self.sampler.epoch} (ranks at different epochs?)")
        fixed, per_sample = values[world + 1:2 * world + 1], values[2 * world + 1:3 * world + 1]
        self._known = [StepCost(a, b) for a, b in zip(fixed, per_sample)]
        within = values[3 * world + 1:4 * world + 1]
        self._within_s = {g: t for g, t in zip(self._vendor_groups, within) if t >= 0}
        self._exchange_s = values[-1]
        old = self.sampler.split
        self.sampler.set_split(new, after_draws=None)
        self._since_round = 0  # the trainers' round of this epoch start, counted as theirs
        me = dist.get_rank(self.world_group)
        self._owed = _trainers(new)[0]  # this epoch's end comes from the first trainer (called back: now, below)
        if new[me] == 0:
            self._receive_state(source, after_step=True)
        else:
            if self._published:  # trained again, it is measured: its probe's cost is withdrawn
                _te.default_store().set(_cost_key(me), _NO_COST)
                self._published = False
            self._receive_state(source)
            self._train_in(_trainers(new))
            self._skip = self.warmup_steps
        self.history.append(RebalanceDecision(step=self._step, epoch=epoch, per_sample_s=[], old=old, new=new,
                                              applied=new != old))

    def _serve_as_spare(self, epoch: int) -> None:
        """The sampler benched this rank at its draw of a step. A loader that draws ahead (workers, a
        prefetch) drew it while batches handed out before it are still to train with the others: the
        wait for the epoch's end then comes after the optimizer step of the last of them."""
        handed_out = self.sampler.state_dict()["step"] - 1  # the steps before this draw
        if self._steps_trained < handed_out:
            self._serve_after = handed_out
        else:
            self.serve_epoch()

    def serve_epoch(self) -> None:
        """A benched rank's pass over an epoch: it waits for the epoch's end and takes the state
        (called for you where its loader would start the epoch)."""
        source = self._owed if self._owed is not None else self._source()
        self._receive_state(source)
        self._owed = self._serve_after = None

    def wait_sent(self) -> None:
        """Waits until the benched ranks have what was sent to them (call it before the group ends)."""
        for works, _ in self._sending:
            for work in works:
                work.wait()
        self._sending = []

    def _send(self, tensors: List[torch.Tensor], ranks: List[int]) -> list:
        """Sends ``tensors`` to each of ``ranks`` without waiting (one message); they are kept until
        they arrive. The store counts the messages sent to each rank: its wait may outlast any op.
        Returns the sends' works."""
        self._sending = [(works, kept) for works, kept in self._sending if not all(w.is_completed() for w in works)]
        works = [dist.isend(t, r, group=self.world_group) for r in ranks for t in tensors]
        self._sending.append((works, tensors))
        store = _te.default_store()
        for r in ranks:
            store.add(_message_key(r), 1)
        return works

    def _packed(self, tensors: List[torch.Tensor], reuse: bool = True) -> Tuple[torch.Tensor, list]:
        """``tensors``' bytes, one after the other (:func:`_layout`), in one buffer on this rank's
        device: one message however many tensors a model and its optimizer hold. The last snapshot's
        buffer is reused (``reuse``) when it has arrived and has their layout (a copy into memory in
        use: no allocation, no page faults, on the step that ends the epoch). Returns it and their specs."""
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        offsets, total = _layout(specs)
        flat = None
        if reuse and self._snapshot is not None:
            last, last_specs, works = self._snapshot
            if last_specs == specs and all(w.is_completed() for w in works):
                flat = last
        if flat is None:
            flat = torch.empty(total, dtype=torch.uint8, device=self._device)
        if tensors:
            torch._foreach_copy_(_views(flat, specs, offsets), [t.detach() for t in tensors])
        return flat, specs

    def _await_message(self, source: int) -> None:
        """A benched rank's wait for its next message from ``source``, however long (see :meth:`_send`).
        No op is pending meanwhile, so nothing else would notice ``source`` die: on kaitian the wait
        asks the backend, which breaks the group (naming ``source``) once it is gone. Not under
        ``while_waiting`` (kaitian.elastic's look at the members): there the trainers also close the
        group to re-form it (admitting a joiner), which is no loss, and the members' liveness tells."""
        store, key = _te.default_store(), _message_key(dist.get_rank(self.world_group))
        watch = None
        if self.while_waiting is None:
            try:
                watch = kaitian_backend(self.world_group).watch_peer
            except ValueError:  # another backend: its own timeout is all there is
                pass
        while int(store.add(key, 0)) <= self._received:
            if self.while_waiting is not None:
                self.while_waiting()
            if watch is not None:
                try:
                    watch(source, "message to a benched rank")
                except dist.DistBackendError as exc:
                    raise dist.DistBackendError(f"{exc}. {_LEFT_EARLY}") from None
            self._probe_if_due()
            time.sleep(_SPARE_POLL_S)
        self._received += 1

    def _probe_if_due(self) -> None:
        """A benched rank, every ``probe_every_s``: times its last batch's forward and backward. Its
        first probe stands for the cost the trainers know; when two probes in a row are faster (or
        slower) than the published cost by more than a quarter, the cost scaled by the last one's
        ratio is published, for the next epoch start's round (a new regime, not one noisy probe)."""
        if self.probe_every_s <= 0 or time.monotonic() < self._next_probe:
            return
        model, me = self._model_ref(), dist.get_rank(self.world_group)
        inputs = model.last_inputs if model is not None else None
        if inputs is None or not self._known[me].known:
            return
        try:
            seconds = probe_seconds(model.module, inputs, self._device)
        except Exception as exc:  # noqa: BLE001 (any model error: the spare keeps its last cost)
            _log.warning("re-balancer: rank %d cannot probe its own speed while benched (%s: %s); "
                         "its cost stays as last measured", me, type(exc).__name__, exc)
            self.probe_every_s = 0.0
            return
        self._next_probe = time.monotonic() + self.probe_every_s
        if not seconds:
            return
        if self._probe is None:
            self._probe = (seconds, self._known[me], 1.0, None)
            return
        first_s, cost, published, off = self._probe
        ratio = seconds / first_s
        if abs(ratio / published - 1.0) <= _PROBE_CHANGE:
            self._probe = (first_s, cost, published, None)
        elif off is None or (off > published) != (ratio > published):
            self._probe = (first_s, cost, published, ratio)
        else:
            self._probe, self._published = (first_s, cost, ratio, None), True
            _te.default_store().set(_cost_key(me), f"{cost.fixed_s * ratio!r},{cost.per_sample_s * ratio!r}")

    def _published_costs(self, read: bool) -> List[float]:
        """``[fixed, per-sample]`` per rank: a benched rank's published cost where ``read`` and there
        is one, else ``-1`` (the first training rank reads them, so that every trainer decides on the same;
        at most twice per ``probe_every_s``, the most often a spare can publish: the store is a round trip)."""
        values = [-1.0] * (2 * self.world)
        if not read or self.probe_every_s <= 0 or time.monotonic() < self._next_read:
            return values
        self._next_read = time.monotonic() + self.probe_every_s / 2
        store = _te.default_store()
        for r in self._spares():
            key = _cost_key(r)
            if not store.check([key]):
                continue
            try:
                cost = published_cost(store.get(key))
            except ValueError as exc:
                _log.warning("re-balancer: rank %d's published step cost is ignored: %s", r, exc)
                continue
            if cost is not None:
                values[2 * r], values[2 * r + 1] = cost.fixed_s, cost.per_sample_s
        return values

    def _send_state(self, spares: List[int], after_step: bool = False) -> None:
        """The first training rank (the callers check) sends the model, the optimizer's state and
        ``state`` to ``spares``, without waiting for them: a copy goes out while it trains on.
        ``after_step``: only what a loop changes after the optimizer step that ends an epoch, which
        the copy taken in that step lacks - the optimizer's hyperparameters (an LR schedule's step)
        and ``state`` (a GradScaler's update, an EMA model's) - at the next epoch start.

        Three tensors, whatever the model: a header (the sizes of the next two, the job's steps), the
        states' structure pickled with its tensors' shapes and dtypes, and every tensor's bytes packed
        in one buffer (a benched rank on a slow device spends its time receiving, not unpickling).
        """
        leaves: List[torch.Tensor] = []
        blob = pickle.dumps(_skeleton([obj.state_dict() for obj in self._travelling(after_step)], leaves))
        with torch.no_grad():  # a snapshot: the next steps change the originals
            flat, specs = self._packed([*self._model_tensors(after_step), *leaves], reuse=not after_step)
        header = torch.tensor([len(blob), flat.numel(), self._job_steps], dtype=torch.int64)
        works = self._send([header, torch.frombuffer(bytearray(blob), dtype=torch.uint8), flat], spares)
        if not after_step:
            self._snapshot = (flat, specs, works)

    def _receive_state(self, source: int, after_step: bool = False) -> None:
        """A benched rank takes the state the first training rank sends (see :meth:`_send_state`)."""
        group = self.world_group
        header = torch.empty(3, dtype=torch.int64)
        self._await_message(source)
        dist.recv(header, source, group=group)
        size, total, steps = header.tolist()
        if not 0 < size <= _MAX_SKELETON or steps < 0:
            raise TrainingError(f"re-balancer: rank {source} sent a state of {size} bytes after {steps} steps to a "
                                "benched rank")
        data = torch.empty(size, dtype=torch.uint8)
        dist.recv(data, source, group=group)
        skeleton = pickle.loads(data.numpy().tobytes())
        leaves = [torch.empty(shape, dtype=dtype) for shape, dtype in _leaf_specs(skeleton)]
        targets = [*self._model_tensors(after_step), *leaves]
        specs = [(tuple(t.shape), t.dtype) for t in targets]
        offsets, expected = _layout(specs)
        if total != expected:
            raise TrainingError(f"re-balancer: rank {source} sent {total} bytes of tensors to a benched rank "
                                f"whose model and optimizer state take {expected} (a different model?)")
        flat = torch.empty(total, dtype=torch.uint8, device=self._device)
        dist.recv(flat, source, group=group)
        with torch.no_grad():
            if targets:
                torch._foreach_copy_([t.data for t in targets], _views(flat, specs, offsets))
        objects = self._travelling(after_step)
        states = _filled(skeleton, iter(leaves))
        if len(states) != len(objects):
            raise TrainingError(f"re-balancer: rank {source} sent a benched rank the state of {len(states)} objects "
                                f"for its {len(objects)} (the optimizer and state=)")
        for obj, state in zip(objects, states):
            obj.load_state_dict(state)
        self._job_steps = steps

    def _travelling(self, after_step: bool) -> list:
        """The objects whose ``state_dict`` a copy for the spares holds (see :meth:`_send_state`)."""
        return [_Hyperparameters(self.optimizer) if after_step else self.optimizer, *self.state]

    def _model_tensors(self, after_step: bool) -> List[torch.Tensor]:
        """The model's parameters and buffers, in a whole copy for the spares."""
        model = self._model_ref()
        return [] if after_step else [*model.module.parameters(), *model.module.buffers()]

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's fitted step cost as of the last round this rank took part in, and the exchange's.

        The same on the ranks that train together, so a ``torch.distributed.checkpoint`` keeps one
        copy; no collective, so the training ranks may call it between steps while a benched one waits.
        """
        return {"per_sample_s": [c.per_sample_s for c in self._known], "fixed_s": [c.fixed_s for c in self._known],
                "exchange_s": self._exchange_s, "within_s": dict(self._within_s), "step": self._step,
                "steps": self._job_steps, "world": self.world}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_dict`: every rank's fitted step cost comes back (a benched rank's
        decides its call-back as before)."""
        if int(state["world"]) != self.world:
            raise ValueError(f"re-balancer state of {state['world']} ranks cannot resume {self.world}")
        fixed = [float(a) for a in state.get("fixed_s", [0.0] * self.world)]
        self._known = [StepCost(a, float(b)) for a, b in zip(fixed, state["per_sample_s"])]
        own = self._known[self.sampler.rank]
        self._cost = own if own.known else None
        self._exchange_s = float(state.get("exchange_s", 0.0))
        self._within_s = {str(g): float(t) for g, t in state.get("within_s", {}).items()}
        self._step = int(state["step"])
        self._job_steps = int(state.get("steps", 0))
        self._fit.clear()
        self._fit_window_done()
        self._skip = self.warmup_steps


_MAX_SKELETON = 1 << 30  # bytes of a state's structure (its tensors travel apart)
_ALIGN = 16  # bytes: a packed tensor's start (the largest dtype's size)


def scheduler_left_out(optimizer: torch.optim.Optimizer, objects: Sequence[Any]) -> bool:
    """Whether an LR scheduler steps ``optimizer`` (torch marks the ``step`` of an optimizer a scheduler
    was made for) and none of ``objects`` is one of its: a rank that takes the optimizer's state from
    the others, and not that scheduler's, would step with another learning rate."""
    return hasattr(optimizer.step, "_wrapped_by_lr_sched") and not any(
        getattr(obj, "optimizer", None) is optimizer for obj in objects)


class _Hyperparameters:
    """An optimizer's hyperparameters, its param_groups less their params (what an LR schedule
    steps), as an object with a state_dict."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> List[Dict[str, Any]]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def load_state_dict(self, groups: List[Dict[str, Any]]) -> None:
        if len(groups) != len(self.optimizer.param_groups):
            raise TrainingError(f"re-balancer: a benched rank received the hyperparameters of {len(groups)} "
                                f"parameter groups for its optimizer's {len(self.optimizer.param_groups)}")
        for group, hyper in zip(self.optimizer.param_groups, groups):
            group.update(hyper)


def _trainers(split: Sequence[int]) -> List[int]:
    """The ranks with samples in ``split``."""
    return [r for r, n in enumerate(split) if n > 0]


def _reduce_speed(group: dist.ProcessGroup) -> float:
    """This rank's host reduce speed on backend kaitian (elements per second; 0: unknown)."""
    from kaitian.backend.stripes import reduce_speed

    try:
        return reduce_speed(group)
    except ValueError:
        return 0.0


def _message_key(rank: int) -> str:
    """The store's count of the re-balancer's messages sent to benched ``rank``."""
    return f"kaitian/rebalance/spare-messages/{rank}"


def _cost_key(rank: int) -> str:
    """Where benched ``rank`` publishes the step cost its probes measure (``_NO_COST``: none)."""
    return f"kaitian/rebalance/spare-cost/{rank}"


_NO_COST = "none"
# Why a benched rank's wait can end with its trainers gone though nothing failed.
_LEFT_EARLY = ("A benched rank waits for the state at the end of the trainers' pass: a loop the trainers leave "
               "within an epoch (max_steps, a step limit) ends with balancer.finish() on every rank, and counts "
               "balancer.steps (the job's, the same on a benched rank)")


def published_cost(value: bytes) -> Optional[StepCost]:
    """The step cost a benched rank published (``None``: withdrawn).

    Raises:
        ValueError: ``value`` is not ``FIXED,PER_SAMPLE`` seconds (finite, the per-sample part positive).
    """
    if value == _NO_COST.encode():
        return None
    try:
        fixed, per_sample = (float(v) for v in value.decode().split(","))
    except ValueError:
        fixed = per_sample = math.nan
    if not (math.isfinite(fixed) and math.isfinite(per_sample) and fixed >= 0 and per_sample > 0):
        raise ValueError(f"{value[:64]!r} is not 'FIXED,PER_SAMPLE' seconds")
    return StepCost(fixed, per_sample)


@dataclass(frozen=True)
class _Leaf:
    """Where a tensor stood in a state: its place in the leaves, shape and dtype."""

    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _skeleton(value, leaves: List[torch.Tensor]):
    """``value`` with each tensor replaced by a :class:`_Leaf` (the tensor appended to ``leaves``)."""
    if isinstance(value, torch.Tensor):
        leaves.append(value.detach())
        return _Leaf(len(leaves) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _skeleton(v, leaves) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v, leaves) for v in value)
    return value


def _leaf_specs(skeleton) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
    """The shapes and dtypes of a skeleton's leaves, in order."""
    found: List[_Leaf] = []

    def walk(value) -> None:
        if isinstance(value, _Leaf):
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(skeleton)
    if [leaf.index for leaf in found] != list(range(len(found))):
        raise TrainingError("re-balancer: the spares' state arrived out of order")
    return [(leaf.shape, leaf.dtype) for leaf in found]


def _layout(specs: Sequence[Tuple[Tuple[int, ...], torch.dtype]]) -> Tuple[List[int], int]:
    """Where each tensor's bytes start in a packed buffer, and its size: in order, each at a
    multiple of 16 bytes (so that any dtype can view its place)."""
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        end += (math.prod(shape) * dtype.itemsize + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, end


def _views(flat: torch.Tensor, specs, offsets: List[int]) -> List[torch.Tensor]:
    """Each tensor's place in a packed buffer, as a tensor of its shape and dtype."""
    return [flat[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), o in zip(specs, offsets)]


def _filled(skeleton, leaves):
    """The skeleton with its leaves put back (``leaves``: an iterator, in order)."""
    if isinstance(skeleton, _Leaf):
        return next(leaves)
    if isinstance(skeleton, dict):
        return {k: _filled(v, leaves) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_filled(v, leaves) for v in skeleton)
    return skeleton

