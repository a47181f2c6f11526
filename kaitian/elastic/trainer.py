"""``kaitian.elastic.Trainer``: a training loop that survives lost devices (docs/elastic.md).

It owns what must survive a loss: the model (wrapped again on every new
group), the optimizer, the sampler and the re-balancer, and the position in
training. Each step: draw this rank's share of the global batch, forward and
backward (DDP's all-reduce), a small *commit* all-reduce, the optimizer step.
A lost peer breaks the process group on every rank (fail-stop); the survivors
agree on a new generation (:mod:`kaitian.elastic.membership`), build its
group, take the state of the member that applied the most steps when they
differ (and hand it to joiners), re-split the same global batch, and redo the
step in flight.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.utils.data

from kaitian.elastic import group as _group
from kaitian.elastic.membership import Announcement, MemberLost, Membership, Decision
from kaitian.elastic.state import broadcast_state, rng_state, set_rng_state
from kaitian.errors import ElasticError, TrainingError
from kaitian.settings import settings

__all__ = ["Trainer", "StepInfo", "Event"]

_log = logging.getLogger(__name__)

_STORE_TIMEOUT_S = 30.0
_POLL_S = 0.2  # the first training rank looks for joiners and the next generation at most this often
_NOTHING, _JOINER, _NEXT_GENERATION = 0, 1, 2  # what it found, carried by the step's commit
_LAUNCH_SETUP_S = 600.0  # building the launch group: workers start seconds (containers: minutes) apart
_REFORM_SETUP_S = 30.0  # building a later one: every member was ready (a member lost meanwhile costs this)


@dataclass(frozen=True)
class StepInfo:
    """One applied step, as ``on_step`` sees it.

    Attributes:
        epoch, step: the step's place (step within the epoch).
        applied: optimizer steps applied so far, this one included.
        rank, world, generation: this rank in the generation that ran it.
        indices: this rank's sample indices in the step.
        loss: this rank's loss (detached; ``float(loss)`` syncs a device).
        split: every rank's batch in the step.
    """

    epoch: int
    step: int
    applied: int
    rank: int
    world: int
    generation: int
    indices: List[int]
    loss: torch.Tensor
    split: List[int]


@dataclass(frozen=True)
class Event:
    """A change of membership, as ``on_event`` sees it.

    Attributes:
        kind: ``"lost"`` (a failure broke the group), ``"agreed"`` (the next
            generation's decision is made), ``"reformed"`` (it trains),
            ``"joined"`` (this worker was admitted and has the state).
        generation: the generation it concerns (``lost``: the broken one).
        time: ``time.time()`` when it happened.
        detail: the failure (``lost``), else ``""``.
        members: the new generation's members (``agreed``, ``reformed``, ``joined``).
        redone: the step in flight is redone (``reformed``).
        transferred: the state was sent to some members (``reformed``, ``joined``).
    """

    kind: str
    generation: int
    time: float
    detail: str = ""
    members: List[str] = field(default_factory=list)
    redone: bool = False
    transferred: bool = False


StepFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class Trainer:
    """Trains through lost and returning devices under ``kaitianrun --on-failure continue``.

    Build the model and optimizer the same way on every worker (a restarted
    worker builds them too, then receives the live state). Then::

        trainer = kaitian.elastic.Trainer(model, optimizer, dataset, batch_size=32, rebalance=True)
        trainer.fit(step, epochs=10)          # step(model, batch) -> mean loss of this rank's batch

    The trainer creates the process group (backend ``kaitian``). Without
    ``--on-failure continue`` (or under plain torchrun) it is a plain loop and
    a loss is raised as in any script.

    Args:
        model: the module, on this rank's device (``kaitian.device()``).
        optimizer: its optimizer.
        dataset: a map-style dataset; batches are ``collate_fn`` of its items.
        batch_size: per-rank batch of an equal split at launch; the global
            batch, ``batch_size`` x the launch world, stays the same whoever is left.
        shuffle, seed, drop_last, capabilities, min_batch_size: as
            :class:`kaitian.DistributedSampler`.
        collate_fn: default ``torch.utils.data.default_collate``.
        ddp: ``"kaitian"`` (:class:`kaitian.DistributedDataParallel`) or
            ``"torch"`` (torch's DDP, loss weighted by :func:`kaitian.scale_loss`).
        ddp_kwargs: more arguments for the DDP wrapper.
        comm_hook: ``(state, hook)`` registered on every DDP wrapper.
        rebalance: ``True`` or :class:`kaitian.Rebalancer` keyword arguments
            (kaitian's DDP only); ``None``: keep the split. A rank whose step
            does not pay is benched as a hot spare (it receives the state at
            each epoch's end, outside every step's collectives) and trains
            again when it pays or when a training rank is lost.
        stateful: more objects with ``state_dict``/``load_state_dict`` (LR
            schedulers, counters) handed to joiners; their state must be plain
            data and tensors. An LR scheduler of ``optimizer`` must be among
            them (:meth:`fit` raises otherwise: a joiner would restart it).
        timeout: the process group's timeout in seconds: a silent peer (a
            stopped process, a hung device) counts as lost after it.
        quorum_timeout: seconds to wait for a member that neither answered
            nor is known to be gone before the survivors go on without it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset,
        *,
        batch_size: int = 32,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        capabilities: Optional[Union[Sequence[float], Mapping[int, float]]] = None,
        min_batch_size: int = 1,
        collate_fn: Optional[Callable[[list], Any]] = None,
        ddp: str = "kaitian",
        ddp_kwargs: Optional[Dict[str, Any]] = None,
        comm_hook: Optional[tuple] = None,
        rebalance: Union[None, bool, Dict[str, Any]] = None,
        stateful: Optional[Dict[str, Any]] = None,
        timeout: float = 60.0,
        quorum_timeout: float = 10.0,
    ) -> None:
        if ddp not in ("kaitian", "torch"):
            raise ValueError(f"ddp must be 'kaitian' or 'torch', got {ddp!r}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not 0 < float(timeout) < math.inf:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
        if not 0 <= float(quorum_timeout) < math.inf:
            raise ValueError(f"quorum_timeout must be a finite number of seconds >= 0, got {quorum_timeout}")
        if rebalance and ddp != "kaitian":
            raise ValueError("rebalance needs ddp='kaitian' (the re-balancer times kaitian's DDP)")
        self.module = model
        self.optimizer = optimizer
        self.dataset = dataset
        self._sampler_args = dict(batch_size=int(batch_size), shuffle=shuffle, seed=seed, drop_last=drop_last,
                                  capabilities=capabilities, min_batch_size=min_batch_size)
        self._collate = collate_fn or torch.utils.data.default_collate
        self._ddp_kind = ddp
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._comm_hook = comm_hook
        self._rebalance_args = None if not rebalance else ({} if rebalance is True else dict(rebalance))
        if self._rebalance_args and {"optimizer", "state"} & set(self._rebalance_args):
            raise ValueError("kaitian.elastic.Trainer hands its re-balancer the optimizer and stateful= itself "
                             "(drop optimizer= and state= from rebalance)")
        self.stateful = dict(stateful or {})
        self.timeout = float(timeout)
        self.quorum_timeout = float(quorum_timeout)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        s = settings()
        self._me = s.elastic_id
        self._joining = s.elastic_join
        self._min_nodes = s.elastic_min_nodes
        self._membership: Optional[Membership] = None
        if self._me is not None:
            store = _group.workers_store(_STORE_TIMEOUT_S)
            self._membership = Membership(store, s.elastic_run, self._me, self.quorum_timeout)
        self.model: Optional[torch.nn.Module] = None  # the DDP wrapper of the current generation
        self.sampler = None
        self._global_batch = 0
        self.rebalancer = None
        self.decision: Optional[Decision] = None
        self.applied = self.epoch = self.step = 0
        self.events: List[Event] = []
        self._on_event: Optional[Callable[[Event], None]] = None
        self._epoch_started: Optional[int] = None
        self._last_poll = 0.0

    # -- public ---------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def generation(self) -> int:
        return self.decision.generation if self.decision is not None else 0

    def fit(self, step_fn: StepFn, epochs: int, on_step: Optional[Callable[[StepInfo], None]] = None,
            on_event: Optional[Callable[[Event], None]] = None) -> bool:
        """Trains until ``epochs`` epochs are done, through losses and joins.

        Args:
            step_fn: ``step_fn(model, batch) -> loss``: the mean loss over this
                rank's batch (``batch`` is on the model's device); the trainer
                runs backward and the optimizer.
            epochs: epochs to train in all.
            on_step: called after each applied step with a :class:`StepInfo`.
            on_event: called with each :class:`Event` (a loss, a new generation).

        Returns:
            ``True`` once training is done; ``False`` for a restarted worker
            that came back after the end (it trained nothing; save nothing).

        Raises:
            ElasticError: the job cannot go on (the message says why): this
                worker was excluded, too few nodes are left, the store is gone.
        """
        from kaitian.training.rebalance import scheduler_left_out

        if scheduler_left_out(self.optimizer, list(self.stateful.values())):
            raise TrainingError(
                "kaitian.elastic.Trainer: the optimizer has an LR scheduler that stateful= does not hold; a worker "
                "that joins or comes back takes the optimizer's state from the others but would start its schedule "
                "again, and step with another learning rate: pass it, Trainer(..., stateful={'scheduler': "
                "scheduler}) (or trainer.stateful['scheduler'] = scheduler before fit)")
        self._on_event = on_event
        if not self._start():
            return False
        while self.epoch < epochs:
            try:
                self._train_step(step_fn, on_step)
                continue
            except Exception as exc:  # noqa: BLE001 (sorted below: only a loss is handled)
                failure = None
                if self._membership is not None:
                    training = getattr(self.model, "training_group", None)
                    failure = str(exc) if isinstance(exc, MemberLost) else _group.loss_of(exc, training)
                if failure is None:
                    raise
            # Outside the handler: the failed step's frames (and the model they hold) are gone.
            self._recover(failure)
        if self.rebalancer is not None:
            self.rebalancer.wait_sent()  # the spares' last copy, before the group ends
        if self._membership is not None:
            self._membership.finish(self.rank)
        return True

    def close(self) -> None:
        """Drops the model and the process group (call it after ``fit``, on every worker)."""
        self.rebalancer = None
        self._tear_down()

    # -- starting -------------------------------------------------------------------

    def _start(self) -> bool:
        """Forms the first group (launch world) or joins a running job; ``False``: nothing left to train."""
        if self._membership is None:
            if not dist.is_initialized():
                from datetime import timedelta

                dist.init_process_group("kaitian", timeout=timedelta(seconds=self.timeout))
            self._launch_sampler(dist.get_world_size(), dist.get_rank())
            self._wrap()
            return True
        if self._joining:
            return self._join()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self._global_batch = self._sampler_args["batch_size"] * world
        self.decision = self._membership.launch(rank, world, _LAUNCH_SETUP_S)
        try:
            self._enter(self.decision)
        except Exception as exc:  # noqa: BLE001 (a loss while the launch group forms)
            failure = _group.loss_of(exc)
            if failure is None:
                raise
            self._recover(failure)
        return True

    def _join(self) -> bool:
        m = self._membership
        m.register_joiner(Announcement(self._me, None, group=settings().group or self.device.type))
        _log.info("kaitian elastic: %s waits to join the running job", self._me)
        decision = self._store_call(m.await_admission)
        if decision is None:
            _log.info("kaitian elastic: training ended before %s was admitted", self._me)
            return False
        self.applied = None  # no state until a member sends it
        self._global_batch = sum(decision.split)
        self.decision = decision
        try:
            self._store_call(m.ready, decision)
            self._enter(decision)
        except Exception as exc:  # noqa: BLE001
            failure = str(exc) if isinstance(exc, MemberLost) else _group.loss_of(exc)
            if failure is None:
                raise
            self._recover(failure)
        self._emit(Event("joined", self.generation, time.time(), members=list(self.decision.members),
                         transferred=True))
        return True

    # -- a generation ------------------------------------------------------------------

    def _enter(self, decision: Decision) -> None:
        """Builds ``decision``'s group and continues in it (state from the source when members differ)."""
        rank, world = decision.members.index(self._me), len(decision.members)
        setup = _LAUNCH_SETUP_S if decision.generation == 0 else _REFORM_SETUP_S
        _group.form(self._membership.store, self._membership.key(f"pg/{decision.generation}/"), rank, world,
                    self.timeout, setup)
        if decision.generation == 0:
            self._launch_sampler(world, rank)  # the launch split: capabilities, exchanged in the group
        else:
            if self.sampler is None:  # a joiner (or the launch group never formed)
                self._global_sampler()
            self.sampler.reshape(world, rank, decision.split)
        self.sampler.first_step = decision.step  # this generation's pass over the epoch starts there
        self._wrap()
        if decision.source >= 0:
            state = broadcast_state(self._state() if rank == decision.source else None, decision.source, self.device)
            if rank != decision.source:
                self._load(state)
        self.applied, self.epoch, self.step = decision.applied, decision.epoch, decision.step
        self.sampler.epoch = self.epoch
        self._epoch_started = self.epoch if self.step > 0 else None
        self.decision = decision

    def _launch_sampler(self, world: int, rank: int) -> None:
        from kaitian.training.sampler import DistributedSampler

        self.sampler = DistributedSampler(self.dataset, num_replicas=world, rank=rank, **self._sampler_args)
        self._global_batch = self.sampler.global_batch_size

    def _global_sampler(self) -> None:
        """A sampler of the job's global batch before this worker has a place in it (cut by ``reshape``)."""
        from kaitian.training.sampler import DistributedSampler

        args = dict(self._sampler_args, batch_size=self._global_batch, capabilities=[1.0])
        self.sampler = DistributedSampler(self.dataset, num_replicas=1, rank=0, **args)

    def _wrap(self) -> None:
        """Wraps the module for the current group (and points the re-balancer at it)."""
        if self._ddp_kind == "kaitian":
            from kaitian.training.ddp import DistributedDataParallel as DDP

            wiring = {"sampler": self.sampler}
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            wiring = {}
        self.model = DDP(self.module, **wiring, **self._ddp_kwargs)
        if self._comm_hook is not None:
            self.model.register_comm_hook(*self._comm_hook)
        if self._rebalance_args is not None:
            if self.rebalancer is None:
                from kaitian.training.rebalance import Rebalancer

                self.rebalancer = Rebalancer(self.sampler, self.model, optimizer=self.optimizer,
                                             state=list(self.stateful.values()), **self._rebalance_args)
                if self._membership is not None:
                    self.rebalancer.while_waiting = self._check_generation
            else:
                self.rebalancer.rebind(self.model)

    # -- a step -------------------------------------------------------------------------

    def _train_step(self, step_fn: StepFn, on_step) -> None:
        if self.step == 0 and self._epoch_started != self.epoch:
            self.sampler.set_epoch(self.epoch)  # a benched rank learns here whether it trains again
            self._epoch_started = self.epoch
        indices = self.sampler.draw(self.step)
        if not indices:
            self._sit_out_epoch()
            return
        split = self.sampler.split
        batch = _to_device(self._collate(self._items(indices)), self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss = step_fn(self.model, batch)
        if self._ddp_kind == "torch":
            from kaitian.training.weighting import scale_loss

            scaled = scale_loss(loss, count=len(indices), sampler=self.sampler)
        else:
            scaled = loss
        scaled.backward()
        joiners = self._commit()
        self.optimizer.step()
        self.applied += 1
        info = StepInfo(self.epoch, self.step, self.applied, self.rank, self.world, self.generation,
                        list(indices), loss.detach(), split)
        self.step += 1
        if self.step >= self.sampler.num_steps:
            self.epoch, self.step = self.epoch + 1, 0
        if on_step is not None:
            on_step(info)
        if joiners:
            self._reform()

    def _sit_out_epoch(self) -> None:
        """A benched rank (a hot spare) takes no step until the epoch's end, whose state it receives;
        a lost training rank breaks the wait, and the next generation trains on it."""
        self.rebalancer.serve_epoch()
        self.applied += self.sampler.num_steps - self.step
        self.epoch, self.step = self.epoch + 1, 0

    def _check_generation(self) -> None:
        """A benched rank's look at the job while it waits (it is in no step's collective).

        Raises:
            MemberLost: the others agree on the next generation, or a member is gone.
        """
        m, following = self._membership, self.generation + 1
        if m.announced(following):
            raise MemberLost(f"the members agree on generation {following} (a benched rank learns it while it waits)")
        gone = m.gone() & set(self.decision.members)
        if gone:
            raise MemberLost(f"{sorted(gone)[0]} is gone (a benched rank learns it while it waits)")

    def _items(self, indices: List[int]) -> list:
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(indices)) if getitems is not None else [self.dataset[i] for i in indices]

    def _commit(self) -> bool:
        """The step's last collective before the optimizer: same step everywhere; a joiner waiting?

        Raises:
            MemberLost: a benched rank announced the next generation (one of the others was lost). The
                trainers take part in no collective with it until the epoch's end: they learn it here,
                within the quorum deadline that would leave them out.
        """
        from kaitian.training.exchange import gather_per_rank

        group = getattr(self.model, "training_group", None)  # benched ranks take no part
        news = _NOTHING
        m = self._membership
        if m is not None and dist.get_rank(group) == 0:
            now = time.monotonic()
            if now - self._last_poll >= _POLL_S:
                self._last_poll = now
                if m.announced(self.generation + 1):
                    news = _NEXT_GENERATION
                elif m.joiner_count() > self.decision.joiners_seen:
                    news = _JOINER
        rows = gather_per_rank([news, self.applied, self.epoch, self.step], group=group, device=self.device,
                               dtype=torch.int64)
        positions = {tuple(row[1:]) for row in rows}
        if len(positions) > 1:
            raise TrainingError(f"ranks are at different steps (applied, epoch, step): {sorted(positions)}")
        if rows[0][0] == _NEXT_GENERATION:
            raise MemberLost(f"the members agree on generation {self.generation + 1} (announced by a benched rank "
                             "while this one trained)")
        return rows[0][0] == _JOINER

    # -- a loss ---------------------------------------------------------------------------

    def _recover(self, failure: str) -> None:
        _log.warning("kaitian elastic: generation %d lost a member: %s", self.generation, failure)
        self._emit(Event("lost", self.generation, time.time(), detail=failure))
        self._reform(failure)

    def _reform(self, failure: str = "") -> None:
        """Agrees on the next generation and enters it; again while members keep getting lost.

        Args:
            failure: what broke the group ("": admitting joiners, nobody failed).
        """
        m = self._membership
        expected, generation = list(self.decision.members), self.decision.generation + 1
        redone = bool(failure)
        while True:
            self._tear_down(reforming=True)
            min_batch = self.sampler.min_batch_size if self.sampler is not None else 1
            decision = self._store_call(m.agree, generation, expected, self._announcement(failure), self._global_batch,
                                    min_batch, self._min_nodes, self.decision.joiners_seen)
            if decision.error:
                raise ElasticError(f"kaitian elastic: the job cannot go on: {decision.error}")
            if self._me not in decision.members:
                raise ElasticError(
                    f"kaitian elastic: {self._me} was left out of generation {decision.generation} (it answered "
                    f"after the others had decided); its agent starts it again as a joiner"
                )
            self._emit(Event("agreed", decision.generation, time.time(), members=list(decision.members)))
            try:
                self._store_call(m.ready, decision)
                before = self.applied
                self._enter(decision)
            except Exception as exc:  # noqa: BLE001
                failure = str(exc) if isinstance(exc, MemberLost) else _group.loss_of(exc)
                if failure is None:
                    raise
                _log.warning("kaitian elastic: generation %d failed while forming: %s", decision.generation, failure)
                self._emit(Event("lost", decision.generation, time.time(), detail=failure))
                self.decision, redone = decision, True
                expected, generation = list(decision.members), decision.generation + 1
                continue
            self._emit(Event("reformed", decision.generation, time.time(), members=list(decision.members),
                             redone=redone and before == decision.applied, transferred=decision.source >= 0))
            return

    def _announcement(self, failure: str) -> Announcement:
        share = 0.0
        if self.applied is not None and self.sampler is not None:
            share = self.sampler.local_batch_size / self.sampler.global_batch_size
        return Announcement(self._me, self.applied, self.epoch, self.step, share=share,
                            group=settings().group or self.device.type, failure=failure)

    def _tear_down(self, reforming: bool = False) -> None:
        """Drops the model, then its group (a DDP must not outlive its group)."""
        model, self.model = (weakref.ref(self.model) if self.model is not None else None), None
        _group.tear_down(collect=model is not None and model() is not None, reforming=reforming)

    def _store_call(self, fn, *args):
        """A store request while agreeing: a store that does not answer ends the job with one line."""
        try:
            return fn(*args)
        except (dist.DistError, RuntimeError) as exc:
            if isinstance(exc, (ElasticError, TrainingError)):
                raise
            addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise ElasticError(
                f"kaitian elastic: the workers' store at {addr} is unreachable ({exc}); "
                "the job cannot go on (its agents restart it)"
            ) from None

    # -- the state a member sends -------------------------------------------------------------

    def _state(self) -> Dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "position": [self.applied, self.epoch, self.step],
            "sampler": {"seed": self.sampler.seed},
            "rebalancer": [asdict(d) for d in self.rebalancer.history] if self.rebalancer is not None else None,
            "rng": rng_state(self.device),
            "stateful": {name: obj.state_dict() for name, obj in self.stateful.items()},
        }

    def _load(self, state: Dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.applied, self.epoch, self.step = state["position"]
        self.sampler.seed = int(state["sampler"]["seed"])
        if self.rebalancer is not None and state["rebalancer"] is not None:
            from kaitian.training.rebalance import RebalanceDecision

            self.rebalancer.history = [RebalanceDecision(**d) for d in state["rebalancer"]]
        set_rng_state(state["rng"], self.device)
        for name, obj in self.stateful.items():
            obj.load_state_dict(state["stateful"][name])

    def _emit(self, event: Event) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
