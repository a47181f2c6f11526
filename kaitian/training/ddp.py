"""``kaitian.DistributedDataParallel``: torch's DDP with exact gradients for unequal batches.

Built on the same weighting as :func:`kaitian.scale_loss`: each rank's loss
is scaled by ``n_r · W / N`` before backward, here by scaling the gradient
that enters the model's outputs (the loss is linear in it, so this is the
same as scaling the loss). Because nothing is re-weighted after gradients have
crossed ranks, it is exact where the forward couples ranks (SyncBatchNorm)
and with any communication hook, built-in C++ hooks included.

The split in two parts keeps every rank's factor known at backward time:

* each forward whose outputs receive a gradient contributes ``n_f`` samples;
  its output gradient is scaled by ``n_f / ref`` (``ref``: the previous
  step's mean per rank and micro-batch, the same on every rank);
* at the synchronised backward the ranks exchange their counts (one small
  all-reduce, started when the first gradient bucket is ready, overlapping
  the rest of backward) and the averaged
  gradient is multiplied by one global factor ``ref · W · M / N`` (``M``
  micro-batches, ``N`` samples over all ranks and micro-batches), usually
  exactly 1.

The accumulated gradient is ``M`` times the mean over every sample of the
window (for one micro-batch: the global-batch mean), so dividing the loss by
the number of accumulation steps, as usual, gives the exact window mean even
when micro-batches differ across ranks. Forwards whose outputs never receive
a gradient (evaluation with grad enabled) count nothing and exchange nothing.

The same hooks time each step (device events on accelerators, see
:mod:`kaitian.training.clock`): *compute* runs from the first forward until
the last gradient bucket is ready, *communication* from there until backward
returns, and *wait* is time spent in other collectives (DDP's buffer
broadcast, re-balancing rounds). The re-balancer and the monitor read these.
"""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from kaitian._torch import current_graph_task, queue_autograd_callback
from kaitian.errors import TrainingError
from kaitian.training.clock import StepClock
from kaitian.training.exchange import gather_per_rank, rows
from kaitian.training.listeners import Listeners
from kaitian.training.sampler import DistributedSampler
from kaitian.training.weighting import StepCheck, check_steps

__all__ = ["DistributedDataParallel", "StepTiming", "has_batch_norm", "steps_beside"]

_log = logging.getLogger(__name__)

_AVERAGING_BACKENDS = ("kaitian", "nccl")  # ReduceOp.AVG in one pass (gloo has none)
# Index of gradient_as_bucket_view among torch DDP's positional arguments, self excluded.
_BUCKET_VIEW_POSITION = list(inspect.signature(_TorchDDP.__init__).parameters).index(
    "gradient_as_bucket_view") - 1


@dataclass
class StepTiming:
    """What one synchronised training step cost on this rank.

    Attributes:
        step: index of the step (synchronised backward passes so far).
        samples: this rank's samples in the step (all its micro-batches; the
            views of a batch that one backward pass trains count once).
        global_samples: samples summed over all ranks.
        compute_s: forward + backward compute time (first forward until the
            last gradient bucket is ready; device time on accelerators).
        comm_s: from then until backward returned (the gradient allreduce,
            including waiting for slower ranks).
        wait_s: time in other collectives during the step (buffer broadcast,
            re-balancing round).
        step_s: wall time since the previous step ended (includes data loading
            and the optimizer); for the first step, since its forward began.
        end: ``time.time()`` when the step's backward returned.
    """

    step: int
    samples: int
    global_samples: int
    compute_s: float
    comm_s: float
    step_s: float
    end: float
    wait_s: float = 0.0


def _count_samples(inputs: tuple, kwargs: dict) -> int:
    """Batch size of a forward call: dim 0 of the first tensor argument."""
    if inputs and isinstance(inputs[0], torch.Tensor):  # the usual call: model(batch)
        return int(inputs[0].shape[0]) if inputs[0].dim() > 0 else 1
    stack: List[Any] = list(inputs) + list(kwargs.values())
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() > 0 else 1
        if isinstance(item, (list, tuple)):
            stack[:0] = list(item)
        elif isinstance(item, dict):
            stack[:0] = list(item.values())
    raise TypeError(
        "kaitian.DistributedDataParallel could not find a tensor in the forward "
        "arguments to count the batch; pass count_samples=fn(inputs, kwargs) -> int"
    )


def _grad_tensors(value: Any) -> List[torch.Tensor]:
    """The tensors in a forward's output that will receive a gradient."""
    out, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dataclass_fields__") or hasattr(item, "keys"):  # ModelOutput and friends
            try:
                stack.extend(item.values() if hasattr(item, "values") else vars(item).values())
            except TypeError:
                pass
    return out


_LIVE: "weakref.WeakSet[DistributedDataParallel]" = weakref.WeakSet()  # this process's models


def steps_beside(model: "DistributedDataParallel") -> Dict[int, int]:
    """The synchronised steps so far of every other live kaitian DDP model in ``model``'s process group,
    by ``id``: a second network trained beside it (a GAN's) shows as one whose steps grow."""
    return {id(m): m._kt_state.step for m in list(_LIVE)
            if m is not model and m.process_group is model.process_group}


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (tuples, namedtuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [_map_tensors(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}
    return value


def _unscaled(value: Any, factor: float) -> Any:
    """``value`` with each tensor in it that asks for a gradient behind a view whose gradient is multiplied
    by ``factor`` on its way out (to a GAN's generator, an input's own gradient): this forward's share of
    the weighting, applied to its outputs' gradient, stays inside the model."""
    def unscale(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return tensor
        view = tensor.view_as(tensor)
        view.register_hook(lambda grad: grad * factor)
        return view

    return _map_tensors(unscale, value)


def has_batch_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` contains a BatchNorm layer (it cannot train on a batch of 1)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())


class _Forward:
    """One forward call: its sample count, whether it ends a step, whether backward reached it."""

    __slots__ = ("samples", "sync", "ref", "seen")

    def __init__(self, samples: int, sync: bool, ref: float) -> None:
        self.samples, self.sync, self.ref, self.seen = samples, sync, ref, False


class _StepState:
    """Per-step bookkeeping shared by forward, the gradient hooks and the callbacks."""

    def __init__(self, history: int) -> None:
        self.samples = 0  # samples of forwards that received a gradient, this step
        self.micro = 0  # such forwards (micro-batches)
        self.batches = 0  # the backward passes they got their gradient in (a batch each, its views one)
        self.batch_samples = 0  # ... each pass's first forward's samples: the batches' samples
        self.graph_task = -1  # ... the last of them
        self.finishing = False  # a synchronised forward's outputs got their gradient: the finish is queued
        self.counts = None  # (work, tensor) of the count exchange, once started
        self.table: Optional[list] = None  # every training rank's count row, once known
        self.totals: Optional[tuple] = None  # (global samples, correction), once read
        self.ref = 1.0  # common scale reference
        self.step = 0
        self.wait = 0.0  # time in other collectives this step
        self.wait_in_compute = 0.0  # the part of it inside the compute window
        self.round_requested = False  # rank 0 asked for a re-balancing round
        self.error: Optional[Exception] = None  # found inside a future callback; raised from backward
        self.last_end: Optional[float] = None
        self.first_forward: Optional[float] = None
        self.timings: Deque[StepTiming] = deque(maxlen=history)

    def clear_counts(self) -> None:
        """Forgets the ended step's counts and their exchange."""
        self.samples, self.micro, self.counts, self.table, self.totals = 0, 0, None, None, None
        self.batches, self.batch_samples, self.graph_task, self.finishing = 0, 0, -1, False


class DistributedDataParallel(_TorchDDP):
    """Drop-in for ``torch.nn.parallel.DistributedDataParallel`` (same arguments).

    One default differs: ``gradient_as_bucket_view=True`` (torch: ``False``),
    so gradients live in DDP's communication buckets. That saves a copy of
    every gradient after each allreduce and one gradient's worth of memory -
    per-step costs that a slow device's rank pays at its own speed. Pass
    ``gradient_as_bucket_view=False`` for torch's behaviour (e.g. code that
    replaces or ``detach_()``-es ``param.grad``).

    Gradients are the per-sample mean over the global batch even when ranks
    hold different batch sizes (the short last batch of an epoch too),
    assuming the loss on each rank is the mean over its local batch (the
    default ``reduction="mean"``). See the module docstring for gradient
    accumulation with ``no_sync``. ``join()`` is refused:
    kaitian's sampler gives every rank the same number of steps.

    Args:
        *args: as torch's DDP.
        count_samples: optional ``fn(inputs, kwargs) -> int`` giving the
            number of samples of a forward call (default: dim 0 of the first
            tensor argument); return token counts for token-mean losses.
        timing_history: how many recent :class:`StepTiming` records to keep.
        sampler: the :class:`kaitian.DistributedSampler` whose batches it
            trains on (:meth:`use_sampler`; a :class:`kaitian.Rebalancer`
            gives it too).
        **kwargs: as torch's DDP.
    """

    def __init__(
        self,
        *args: Any,
        count_samples: Optional[Callable[[tuple, dict], int]] = None,
        timing_history: int = 4096,
        sampler: Optional[DistributedSampler] = None,
        **kwargs: Any,
    ) -> None:
        if len(args) < _BUCKET_VIEW_POSITION:  # not passed positionally
            kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(*args, **kwargs)
        from kaitian.monitor.records import recorder_for_this_rank

        self._kt_count_samples = count_samples or _count_samples
        self._kt_state = _StepState(timing_history)
        self._kt_check = StepCheck()
        self._kt_user_hook: Optional[tuple] = None
        self._kt_builtin_hook = None
        self._kt_hook_registered = False
        # Backends that average in their reduction pass; others get torch's divide-then-sum.
        self._kt_avg_op = dist.get_backend(self.process_group) in _AVERAGING_BACKENDS
        self.training_group = self.process_group  # the ranks that train (train_in)
        self._kt_step_listeners = Listeners(weak=False)  # the model keeps its helpers alive
        self._kt_before_step = Listeners(weak=False)
        self._kt_step_ends = Listeners(weak=False)
        self._kt_vote: Optional[Callable[[], bool]] = None
        self._kt_clock = StepClock(self.device)
        self._kt_recorder = recorder_for_this_rank()
        self._kt_sampler: Optional[DistributedSampler] = None
        self._kt_remember_inputs = False
        self._kt_last_inputs: Optional[tuple] = None  # (args, kwargs) of the last training forward
        if sampler is not None:
            self.use_sampler(sampler)
        self._kt_update_solo()
        _LIVE.add(self)

    # -- public ------------------------------------------------------------------

    @property
    def step_timings(self) -> Deque[StepTiming]:
        """Recent :class:`StepTiming` records of this rank (newest last).

        On a device a step's record is made when the next step ends (its
        events are read a step late); reading this property completes the
        newest one too, waiting for its device work.
        """
        self._kt_emit(self._kt_clock.flush())
        return self._kt_state.timings

    @property
    def recorder(self):
        """The monitor's step recorder (``kaitianrun --monitor``), or ``None``."""
        return self._kt_recorder

    def use_sampler(self, sampler: DistributedSampler) -> None:
        """Trains on ``sampler``'s batches; call it on every rank alike, before the first step.

        Its epoch tags each step's count exchange, so ranks at different steps
        are named; a DataLoader whose ``batch_size`` cuts its steps is refused
        at the first step; a model with BatchNorm raises its minimum batch to
        2; its batch size is the first step's scale reference.
        """
        self._kt_sampler = sampler
        if self._kt_state.step == 0 and self._kt_state.first_forward is None:  # no forward scaled yet
            self._kt_state.ref = float(sampler.batch_size)
        if has_batch_norm(self.module):
            sampler.require_min_batch_size(2)

    def bench_blocker(self) -> Optional[str]:
        """Why a rank of this model cannot leave the gradient exchange (be benched), or ``None``.

        A benched rank leaves every per-step collective; a user's communication hook
        or a built-in one reduces over the whole group, and so does DDP's buffer broadcast.
        """
        if self._kt_user_hook is not None or self._kt_builtin_hook is not None:
            return "a communication hook is registered (it reduces over every rank)"
        if self.broadcast_buffers and any(True for _ in self.module.buffers()):
            return ("the model has buffers that DDP broadcasts every step (pass broadcast_buffers=False, "
                    "or forward_sync_buffers=False where torch's DDP has it)")
        return None

    def train_in(self, group: dist.ProcessGroup) -> None:
        """Exchanges gradients and counts among ``group`` only, a subgroup of the model's process group
        holding every rank with samples (the others are benched: they run no step); call it on those
        ranks between steps.

        Raises:
            TrainingError: :meth:`bench_blocker` names why this model cannot.
        """
        if group is not self.process_group:
            blocker = self.bench_blocker()
            if blocker is not None:
                raise TrainingError(f"kaitian.DistributedDataParallel cannot train in a subgroup: {blocker}")
        self.training_group = group
        self._kt_update_solo()
        self._kt_avg_op = dist.get_backend(group) in _AVERAGING_BACKENDS
        # A round the old group voted for is not the new one's: a rank called back has no vote pending.
        self._kt_state.round_requested = False
        # The scale reference must be the same on every member: ranks that come back from
        # the bench hold the one of their last step.
        batch = self._kt_sampler.global_batch_size if self._kt_sampler is not None else group.size()
        self._kt_state.ref = batch / group.size()

    def remember_inputs(self) -> None:
        """From now on, keeps the last training forward's arguments (:attr:`last_inputs`): a benched
        rank's probe of its own speed runs on them."""
        self._kt_remember_inputs = True

    @property
    def last_inputs(self) -> Optional[tuple]:
        """``(args, kwargs)`` of the last training forward since :meth:`remember_inputs`, else ``None``."""
        return self._kt_last_inputs

    def add_step_listener(self, callback: Callable[[StepTiming], None]) -> None:
        """Calls ``callback(timing)`` after each synchronised step (the model holds ``callback``)."""
        self._kt_step_listeners.add(callback)

    def set_round_vote(self, vote: Callable[[], bool]) -> None:
        """Rank 0's ``vote()`` travels with each step's count exchange; the next
        step's before-step callbacks get ``round_requested=True`` on every rank."""
        self._kt_vote = vote

    def add_step_end(self, callback: Callable[[int, int], None]) -> None:
        """Calls ``callback(global_samples, batches)`` as each synchronised step's backward ends (``batches``:
        this rank's backward passes in the step, a batch each, forwards of one pass views of it; at once:
        :meth:`add_step_listener`'s timings may come a step later on a device)."""
        self._kt_step_ends.add(callback)

    def add_before_step(self, callback: Callable[[int, bool], None]) -> None:
        """Calls ``callback(step, round_requested)`` before each synchronised forward.

        Every rank reaches this point at the same step, so the callback may run
        collectives (the re-balancer's rounds do); their time is counted as
        wait, not compute.
        """
        self._kt_before_step.add(callback)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Registers a user communication hook; the batch weighting composes with it.

        The hook must compute a mean across ranks (as torch's ``allreduce_hook``
        and the compression hooks do). Call it once, before the first forward.

        Raises:
            RuntimeError: a hook was already registered.
        """
        if self._kt_user_hook is not None or self._kt_builtin_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        self._check_comm_hook(hook)
        self._kt_user_hook = (state, hook)
        self._kt_update_solo()

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """A built-in C++ hook (e.g. ``BuiltinCommHookType.FP16_COMPRESS``): exact too.

        The global correction is then applied to the gradients after backward
        (one pass over them, only in steps whose global batch changed).
        """
        if self._kt_user_hook is not None or self._kt_builtin_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        self._kt_builtin_hook = comm_hook_type
        self._kt_update_solo()

    def join(self, *args: Any, **kwargs: Any):
        raise TrainingError(
            "kaitian.DistributedDataParallel does not support join(): kaitian.DistributedSampler "
            "gives every rank the same number of steps, so inputs are never uneven; for your own "
            "uneven loader use torch's DDP with kaitian.scale_loss(loss, count, total)"
        )

    def _sync_buffers(self) -> None:
        """DDP's buffer broadcast is a collective that waits for slow ranks: counted as wait."""
        start = time.perf_counter()
        try:
            return super()._sync_buffers()
        finally:
            spent = time.perf_counter() - start
            self._kt_state.wait += spent
            self._kt_state.wait_in_compute += spent

    # -- forward -----------------------------------------------------------------

    def _kt_update_solo(self) -> None:
        """Whether this rank trains alone (a world of one, or its peers benched), with nothing
        torch's DDP must still do: no hook of the user's, no inputs to move to a device. Then a step
        has nothing to exchange: torch's reducer is left out and the counts stay in Python (a step's
        own bookkeeping is all that separates it from a plain local model)."""
        self._kt_solo = (self.training_group.size() == 1 and self._kt_user_hook is None
                         and self._kt_builtin_hook is None and not self.device_ids)

    def _kt_register_hook(self) -> None:
        self._kt_hook_registered = True
        if self._kt_builtin_hook is not None:
            super()._register_builtin_comm_hook(self._kt_builtin_hook)
        else:
            super().register_comm_hook(weakref.ref(self), _weighted_hook)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(*inputs, **kwargs)
        st = self._kt_state
        if not self._kt_hook_registered:
            self._kt_register_hook()
        sync = self.require_backward_grad_sync
        if sync:
            start = time.perf_counter()
            self._kt_before_step(st.step, st.round_requested)
            st.round_requested = False
            st.wait += time.perf_counter() - start
        if st.first_forward is None:
            st.first_forward = time.perf_counter()
            self._kt_clock.mark("start")
        if self._kt_remember_inputs:
            self._kt_last_inputs = (inputs, kwargs)
        record = _Forward(self._kt_count_samples(inputs, kwargs), sync, st.ref)
        if record.samples != record.ref:  # the weighting is this model's: what leaves by its inputs is unscaled
            inputs, kwargs = _unscaled((inputs, kwargs), record.ref / record.samples)
        # One rank trains (a world of one, or the others benched): nothing to exchange, so torch's reducer
        # is left out (its gradient hooks stay idle) and the weighting is applied at the end.
        output = self.module(*inputs, **kwargs) if self._kt_solo else super().forward(*inputs, **kwargs)
        ddp_ref = weakref.ref(self)
        for tensor in _grad_tensors(output):
            tensor.register_hook(lambda grad, r=record: _on_output_grad(ddp_ref, r, grad))
        return output

    # -- backward ----------------------------------------------------------------

    def _kt_on_backward(self, record: _Forward) -> None:
        """The first gradient reached a forward's outputs: count it; at a sync step, queue the step's finish.

        Several forwards may feed one backward (two views of a batch, a GAN's critic on real and fake
        samples): each counts as a micro-batch of the step, so the step's gradient is the sum of their
        global means when they are the same size on each rank."""
        st = self._kt_state
        if st.counts is not None and st.error is None:  # the exchange left without this forward's samples
            st.error = TrainingError(
                "kaitian.DistributedDataParallel: a forward's outputs got their gradient after the first "
                "gradient bucket was ready, so its samples missed the step's count exchange (forwards that "
                "each use part of the model, summed into one loss); run them as one forward"
            )
        st.samples += record.samples
        st.micro += 1
        task = current_graph_task()
        if task != st.graph_task:
            st.graph_task, st.batches, st.batch_samples = task, st.batches + 1, st.batch_samples + record.samples
        if not record.sync or st.finishing:
            return
        st.finishing = True
        st.totals = None
        ddp_ref = weakref.ref(self)

        def finish() -> None:
            ddp = ddp_ref()
            if ddp is not None:
                ddp._kt_finish_step()

        if self._kt_solo:  # torch's reducer is idle: no finaliser to follow
            queue_autograd_callback(finish)
        else:  # queued before DDP's finaliser: this one queues the finish to run after it
            queue_autograd_callback(lambda: queue_autograd_callback(finish))

    def _kt_exchange_counts(self) -> tuple:
        """Starts the step's count exchange once (the first gradient bucket is ready: every forward
        whose outputs feed it has been counted); ``(work, tensor)``."""
        st = self._kt_state
        if st.counts is None:
            tag = self._kt_check.next_tag(self._kt_sampler)
            vote = self._kt_vote() if self._kt_vote is not None and self.training_group.rank() == 0 else 0
            row = [st.samples, st.micro, *tag, int(bool(vote)), st.batch_samples]
            # int64: exact on every vendor (CNCL would round float64 to float32)
            st.counts = gather_per_rank(row, self.training_group, self.device, dtype=torch.int64, async_op=True)
        return st.counts

    def _kt_totals(self, arrived: bool = False) -> tuple:
        """(global samples, correction factor) of this step, identical on every rank.

        Args:
            arrived: the count exchange is known complete (inside its future's
                callback, where waiting on the work would deadlock).
        """
        st = self._kt_state
        if st.totals is None:
            if st.table is None and self._kt_solo:  # no peer to compare its step with, nor a round to vote for
                st.table = [[st.samples, st.micro, 0, 0, 0, 0, st.batch_samples]]
            elif st.table is None:
                work, tensor = self._kt_exchange_counts()
                if work is not None and not arrived:
                    work.wait()
                st.table = rows(tensor)
            table = st.table
            if not self._kt_solo:
                check_steps([row[2:5] for row in table], self._kt_sampler)
                st.round_requested = any(row[5] > 0 for row in table)
            micro = {int(row[1]) for row in table}
            if len(micro) > 1:
                raise TrainingError(
                    "ranks accumulated different numbers of micro-batches in this step: "
                    + ", ".join(f"rank {r}: {int(row[1])}" for r, row in enumerate(table))
                )
            total = sum(row[0] for row in table)
            if total <= 0:
                raise TrainingError("a synchronised step with no samples on any rank")
            world = len(table)
            st.totals = (total, st.ref * world * micro.pop() / total)
        return st.totals

    def _kt_finish_step(self) -> None:
        st = self._kt_state
        if st.error is not None:
            error, st.error = st.error, None
            st.clear_counts()
            raise error
        total, correction = self._kt_totals()
        global_batch = int(sum(row[6] for row in st.table))  # the batches' samples, a batch's views once
        if (self._kt_builtin_hook is not None or self._kt_solo) and correction != 1.0:
            with torch.no_grad():
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(correction)
        self._kt_clock.mark("end")
        now = time.perf_counter()
        start = st.first_forward if st.first_forward is not None else now
        # compute_s and comm_s come from the clock (a step later on a device)
        timing = StepTiming(
            step=st.step,
            samples=st.batch_samples,
            global_samples=global_batch,
            compute_s=0.0,
            comm_s=0.0,
            step_s=max(1e-9, now - (st.last_end if st.last_end is not None else start)),
            end=time.time(),
            wait_s=st.wait,
        )
        ended = self._kt_clock.finish((timing, st.wait_in_compute))
        st.last_end = now
        st.step += 1
        micro, batches = max(1, st.micro), max(1, st.batches)
        st.ref = total / (self.training_group.size() * micro)
        st.first_forward = None
        st.clear_counts()
        st.wait = st.wait_in_compute = 0.0
        self._kt_emit(ended)
        self._kt_step_ends(global_batch, batches)

    def _kt_emit(self, ended) -> None:
        """Completes the clock's ended steps with their times and hands them out."""
        for (timing, wait_in_compute), times in ended:
            timing.compute_s = max(0.0, times["compute_s"] - wait_in_compute)
            timing.comm_s = times["comm_s"]
            self._kt_state.timings.append(timing)
            if self._kt_recorder is not None:
                self._kt_recorder.record_step(timing)
            self._kt_step_listeners(timing)


def _on_output_grad(ddp_ref: "weakref.ref", record: _Forward, grad: torch.Tensor) -> torch.Tensor:
    """Gradient hook on a forward's outputs: scale by ``n_f / ref`` (the loss weighting)."""
    ddp = ddp_ref()
    if ddp is not None and not record.seen:
        record.seen = True
        ddp._kt_on_backward(record)
    factor = record.samples / record.ref
    return grad if factor == 1.0 else grad * factor


def _weighted_hook(ddp_ref, bucket):  # no annotations: torch checks them as real types
    """Comm hook: the mean across ranks (torch's or the user's), then the global correction."""
    ddp = ddp_ref()
    if not ddp._kt_state.finishing:
        raise TrainingError(
            "kaitian.DistributedDataParallel: backward did not pass through the model's outputs "
            "(the loss must be computed from what forward returned)"
        )
    work, _ = ddp._kt_exchange_counts()  # at the first bucket, ahead of its reduction
    group = ddp.training_group
    if ddp._kt_user_hook is None:
        buffer = bucket.buffer()
        if ddp._kt_avg_op:
            op = dist.ReduceOp.AVG
        else:
            buffer.div_(group.size())
            op = dist.ReduceOp.SUM
        reduced = dist.all_reduce(buffer, op=op, group=group, async_op=True).get_future()
    else:
        user_state, user_hook = ddp._kt_user_hook
        reduced = user_hook(user_state, bucket)
    if bucket.is_last():
        ddp._kt_clock.mark("compute_end")

    # Chained on the reduction's own future, so the returned one carries its
    # devices and DDP's wait orders its streams after ours (collect_all would
    # build a CPU future: the optimizer could read the bucket too early).
    def finish(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        grad = value[0] if isinstance(value, (list, tuple)) else value
        if work is not None:
            work.get_future().wait()  # this stream now waits for the counts too
        try:
            _, correction = ddp._kt_totals(arrived=True)
        except TrainingError as exc:  # raised from backward by _kt_finish_step, as itself
            ddp._kt_state.error = exc
            return grad
        return grad if correction == 1.0 else grad.mul_(correction)

    return reduced.then(finish)
