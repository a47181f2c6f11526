"""``kaitian.DistributedDataParallel``: torch's DDP with exact gradients for unequal batches.

Torch's DDP averages the ranks' mean gradients, which is biased when ranks
see different batch sizes. kaitian's DDP counts each rank's samples in every
step (an allreduce of one number, launched at forward so it overlaps with
compute) and weights each rank's gradient by its share::

    g = sum_r n_r * g_r / sum_r n_r    (= the mean over the global batch)

It does so in a communication hook that wraps the plain allreduce, or the
user's own hook (``register_comm_hook`` still works: the user's hook receives
the buckets pre-scaled by ``n_r / ref`` and its mean result is post-scaled by
``ref * world / N``, with the same ``ref`` on every rank). The same hook times
each step: *compute* runs from the first forward of a step until the last
gradient bucket is ready (so time spent waiting in collectives is excluded),
*communication* from there until backward returns. The re-balancer and the
monitor read these timings.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

__all__ = ["DistributedDataParallel", "StepTiming"]

_log = logging.getLogger(__name__)


@dataclass
class StepTiming:
    """What one synchronised training step cost on this rank.

    Attributes:
        step: index of the step (synchronised backward passes so far).
        samples: this rank's samples in the step.
        global_samples: samples summed over all ranks.
        compute_s: forward + backward compute time (first forward until the
            last gradient bucket is ready).
        comm_s: time from then until backward returned (waiting for the
            gradient allreduce).
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


def _weak_callable(callback: Callable) -> Callable[[], Optional[Callable]]:
    """A weak reference to a bound method (no model <-> re-balancer cycle), else a strong one."""
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        return weakref.WeakMethod(callback)
    return lambda: callback


def _count_samples(inputs: tuple, kwargs: dict) -> int:
    """Batch size of a forward call: dim 0 of the first tensor argument."""
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


def _first_value(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (list, tuple)) else value


class _StepState:
    """Per-step bookkeeping shared by forward, the comm hook and the callbacks."""

    def __init__(self, history: int) -> None:
        self.pending_samples = 0  # samples since the last synchronised backward
        self.first_forward: Optional[float] = None
        self.samples = 0
        self.count_future: Optional[torch.futures.Future] = None
        self.ref = 1.0  # common scale reference, the previous step's global mean
        self.next_ref: Optional[float] = None
        self.compute_end: Optional[float] = None
        self.last_end: Optional[float] = None
        self.step = 0
        self.last_global = 0
        self.sync_wait = 0.0  # time in DDP's buffer broadcast, a collective
        self.timings: Deque[StepTiming] = deque(maxlen=history)


class DistributedDataParallel(_TorchDDP):
    """Drop-in for ``torch.nn.parallel.DistributedDataParallel`` (same arguments).

    Gradients are the per-sample mean over the global batch even when ranks
    hold different batch sizes (also the short last batch of an epoch),
    assuming the loss on each rank is the mean over its local batch (the
    default ``reduction="mean"``).

    Args:
        *args: as torch's DDP.
        count_samples: optional ``fn(inputs, kwargs) -> int`` giving the
            number of samples of a forward call (default: dim 0 of the first
            tensor argument).
        timing_history: how many recent :class:`StepTiming` records to keep.
        **kwargs: as torch's DDP.
    """

    def __init__(
        self,
        *args: Any,
        count_samples: Optional[Callable[[tuple, dict], int]] = None,
        timing_history: int = 4096,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._kt_count_samples = count_samples or _count_samples
        self._kt_state = _StepState(timing_history)
        self._kt_user_hook: Optional[tuple] = None
        self._kt_step_listeners: List[Callable[[StepTiming], None]] = []
        self._kt_before_step: List[Callable[[int], None]] = []
        self._kt_recorder = None
        self._kt_keep_alive: List[object] = []  # helpers attached to this model
        self._kt_device = next(
            (p.device for p in self.module.parameters()), torch.device("cpu")
        )
        try:
            from kaitian.training.sampler import _LAST_SAMPLER

            if _LAST_SAMPLER is not None:
                self._kt_state.ref = float(_LAST_SAMPLER.batch_size)
        except ImportError:
            pass
        from kaitian.training.monitor import recorder_for_this_rank

        self._kt_recorder = recorder_for_this_rank()
        # Registered once; the user's hook (if any) is called from inside it.
        super().register_comm_hook(weakref.ref(self), _weighted_hook)

    # -- public ------------------------------------------------------------------

    @property
    def step_timings(self) -> Deque[StepTiming]:
        """Recent :class:`StepTiming` records of this rank (newest last)."""
        return self._kt_state.timings

    def add_step_listener(self, callback: Callable[[StepTiming], None]) -> None:
        """Calls ``callback(timing)`` after each synchronised step."""
        self._kt_step_listeners.append(_weak_callable(callback))

    def add_before_step(self, callback: Callable[[int], None]) -> None:
        """Calls ``callback(step)`` at the start of each synchronised forward.

        Every rank reaches this point at the same step, so the callback may run
        collectives (the re-balancer's every-K-steps mode uses it).
        """
        self._kt_before_step.append(_weak_callable(callback))

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Registers a user communication hook, composed with the batch weighting.

        The hook must compute a mean across ranks (as torch's ``allreduce_hook``
        and the compression hooks do); kaitian scales its input and output so
        the result is the mean over the global batch. Call it once, before the
        first backward.

        Raises:
            RuntimeError: a hook was already registered.
        """
        if self._kt_user_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        self._check_comm_hook(hook)
        self._kt_user_hook = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        raise RuntimeError(
            "kaitian.DistributedDataParallel needs a Python communication hook to weight "
            "unequal batches; use register_comm_hook with torch's default_hooks "
            "(e.g. fp16_compress_hook) instead of a built-in hook"
        )

    def _sync_buffers(self) -> None:
        """Excludes DDP's buffer broadcast (a collective that waits for slow ranks) from compute."""
        start = time.perf_counter()
        try:
            return super()._sync_buffers()
        finally:
            self._kt_state.sync_wait += time.perf_counter() - start

    # -- forward -----------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            st = self._kt_state
            if st.first_forward is None:
                st.first_forward = time.perf_counter()
            st.pending_samples += self._kt_count_samples(inputs, kwargs)
            if self.require_backward_grad_sync:
                for ref in list(self._kt_before_step):
                    cb = ref()
                    if cb is not None:
                        cb(st.step)
                self._kt_launch_count()
        return super().forward(*inputs, **kwargs)

    def _kt_launch_count(self) -> None:
        st = self._kt_state
        st.samples = st.pending_samples
        count = torch.tensor([float(st.samples)], dtype=torch.float32, device=self._kt_device)
        work = dist.all_reduce(count, group=self.process_group, async_op=True)
        st.count_future = work.get_future()
        st.compute_end = None

    # -- after backward ------------------------------------------------------------

    def _kt_finish_step(self) -> None:
        st = self._kt_state
        now = time.perf_counter()
        compute_end = st.compute_end if st.compute_end is not None else now
        start = st.first_forward if st.first_forward is not None else compute_end
        timing = StepTiming(
            step=st.step,
            samples=st.samples,
            global_samples=st.last_global,
            compute_s=max(0.0, compute_end - start - st.sync_wait),
            comm_s=max(0.0, now - compute_end),
            step_s=max(1e-9, now - (st.last_end if st.last_end is not None else start)),
            end=time.time(),
        )
        st.timings.append(timing)
        st.last_end = now
        st.step += 1
        st.first_forward = None
        st.pending_samples = 0
        st.sync_wait = 0.0
        if st.next_ref is not None:
            st.ref, st.next_ref = st.next_ref, None
        if self._kt_recorder is not None:
            self._kt_recorder.record_step(timing)
        for ref in list(self._kt_step_listeners):
            cb = ref()
            if cb is not None:
                cb(timing)


def _queue_after_backward(ddp_ref: "weakref.ref") -> None:
    """Runs the step's bookkeeping once backward (and DDP's finalisation) is over.

    DDP queues its own finalising callback (which waits for the allreduce)
    after the last bucket's hook returns, so we queue a callback that queues
    one more: it runs after DDP's and sees the communication time.
    """
    engine = torch.autograd.Variable._execution_engine

    def outer() -> None:
        def inner() -> None:
            ddp = ddp_ref()
            if ddp is not None:
                ddp._kt_finish_step()

        engine.queue_callback(inner)

    engine.queue_callback(outer)


def _weighted_hook(ddp_ref, bucket):  # no annotations: torch checks them as real types
    """Comm hook: mean over the global batch, weighting each rank by its samples."""
    ddp = ddp_ref()
    st = ddp._kt_state
    group = ddp.process_group
    world = group.size()
    ref = st.ref
    buffer = bucket.buffer()
    if ddp._kt_user_hook is None:
        # One pass over the bucket, as torch's own hook (which divides by world).
        buffer.mul_(st.samples / (ref * world))
        reduced = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    else:
        if st.samples != ref:
            buffer.mul_(st.samples / ref)
        user_state, user_hook = ddp._kt_user_hook
        reduced = user_hook(user_state, bucket)
    if bucket.is_last():
        st.compute_end = time.perf_counter()
        _queue_after_backward(ddp_ref)
    count_future = st.count_future

    def finish(both: torch.futures.Future) -> torch.Tensor:
        grad_fut, count_fut = both.value()
        grad = _first_value(grad_fut.value())
        global_samples = float(_first_value(count_fut.value()).item())
        st.last_global = int(round(global_samples))
        st.next_ref = global_samples / world
        correction = ref * world / global_samples
        # Same global batch as the step before (the usual case): nothing to fix.
        return grad if correction == 1.0 else grad.mul_(correction)

    return torch.futures.collect_all([reduced, count_future]).then(finish)
