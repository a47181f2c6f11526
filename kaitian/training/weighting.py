"""Exact global-batch weighting that works with any DDP: scale each rank's loss by ``n_r · W / N``.

Torch's DDP averages the ranks' gradients: ``g = (1/W) Σ_r ∇L_r``. When rank
``r`` holds ``n_r`` of the step's ``N`` samples and ``L_r`` is the mean over
its own batch, scaling its loss first by ``n_r · W / N`` makes that average
the mean over the global batch, ``Σ_r n_r ∇L_r / N``. The scaling happens
before backward, so it stays exact where the forward couples ranks
(SyncBatchNorm, losses over gathered embeddings) and with any communication
hook, the built-in C++ ones included: nothing is re-weighted after gradients
have crossed ranks.

``count`` may be anything the loss is a mean over: samples, or tokens for a
language-model loss averaged over non-padding tokens.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from kaitian.errors import TrainingError
from kaitian.training.exchange import gather_per_rank
from kaitian.training.sampler import DistributedSampler

__all__ = ["scale_loss", "global_count", "StepCheck", "check_steps", "check_whole_steps"]

Count = Union[int, float, torch.Tensor]


def _world(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _as_float(count: Count) -> float:
    return float(count.item()) if isinstance(count, torch.Tensor) else float(count)


class StepCheck:
    """Tags each exchange with where this rank is, so that ranks at different steps are caught.

    A DataLoader that gives ranks different numbers of batches makes their
    collectives pair up wrongly; the tag names the ranks instead of hanging or
    mixing steps. A tag is the sampler's epoch (0 without one), the step in
    it, and the sampler's :attr:`~kaitian.DistributedSampler.yielded` (see
    :func:`check_steps`).
    """

    def __init__(self) -> None:
        self._epoch: Optional[int] = None
        self._step = 0

    def next_tag(self, sampler: Optional[DistributedSampler]) -> List[int]:
        epoch = sampler.epoch if sampler is not None else 0
        if epoch != self._epoch:
            self._epoch, self._step = epoch, 0
        tag = [epoch, self._step, sampler.yielded if sampler is not None else 0]
        self._step += 1
        return tag


def check_steps(tags: Sequence[Sequence[float]], sampler: Optional[DistributedSampler]) -> None:
    """Raises :class:`TrainingError` naming the ranks if their (epoch, step) tags differ, or if
    a rank's DataLoader cuts the sampler's steps."""
    if len({(int(e), int(s)) for e, s, _ in tags}) > 1:
        where = ", ".join(f"rank {r} at epoch {int(e)} step {int(s)}" for r, (e, s, _) in enumerate(tags))
        raise TrainingError(
            f"ranks are at different steps ({where}): their loaders give them different numbers of "
            "batches; use DataLoader(ds, batch_sampler=sampler.batch_sampler()) or "
            "DataLoader(ds, batch_size=sampler.local_batch_size, sampler=sampler)"
        )
    if sampler is not None:
        check_whole_steps(sampler, [tag[2] for tag in tags])


def check_whole_steps(sampler: DistributedSampler, yielded: Sequence[int]) -> None:
    """Refuses DataLoaders whose batches cut the sampler's steps; ``yielded``: every rank's
    :attr:`~kaitian.DistributedSampler.yielded`.

    A DataLoader that takes whole steps of its rank's share is at a step
    boundary whenever a step trains (also with workers that draw ahead); one
    whose ``batch_size`` is not that share soon is not, and ranks would run
    different numbers of steps.
    """
    if len(yielded) != sampler.num_replicas:
        return
    full, rest = sampler.layout()
    whole = max(0, full - sampler.first_step)  # full steps from where this epoch started
    cut = []
    for rank, (taken, share) in enumerate(zip(yielded, sampler.split)):
        if share == 0:  # benched: no batch of its own to cut (drawn ahead, its last ones may still train)
            continue
        taken = int(taken)
        inside = taken % share != 0 if taken <= whole * share else rest is None or taken != whole * share + rest[rank]
        if inside:
            cut.append(f"rank {rank}'s DataLoader has taken {taken} samples, not whole steps of {share}")
    if cut:
        raise TrainingError(
            f"{', '.join(cut)} (kaitian's split {sampler.split}): a DataLoader's batch_size must be its rank's "
            "share, or ranks run different numbers of steps; use DataLoader(ds, "
            "batch_sampler=sampler.batch_sampler()) (follows re-balancing) or "
            "DataLoader(ds, batch_size=sampler.local_batch_size, sampler=sampler)"
        )


_check = StepCheck()


def global_count(
    count: Count,
    group: Optional[dist.ProcessGroup] = None,
    sampler: Optional[DistributedSampler] = None,
) -> float:
    """The sum of ``count`` over all ranks (a collective: call it on every rank).

    Use it for the ``total`` of :func:`scale_loss` over a gradient-accumulation
    window: ``total = global_count(sum of this rank's counts in the window)``.
    ``sampler``: as in :func:`scale_loss`.
    """
    if _world(group) == 1:
        return _as_float(count)
    counts = gather_per_rank([_as_float(count), *_check.next_tag(sampler)], group)
    check_steps([row[1:] for row in counts], sampler)
    return sum(row[0] for row in counts)


def scale_loss(
    loss: torch.Tensor,
    count: Optional[Count] = None,
    total: Optional[Count] = None,
    group: Optional[dist.ProcessGroup] = None,
    sampler: Optional[DistributedSampler] = None,
) -> torch.Tensor:
    """This rank's mean loss scaled so that any DDP's average is the global-batch mean.

    ``loss * count * W / total``; back-propagate the result instead of ``loss``.

    Args:
        loss: the mean loss over this rank's batch (``reduction="mean"``).
        count: what ``loss`` is a mean over on this rank: samples or tokens.
            Default: the size of the oldest batch ``sampler`` handed out that
            no call has claimed yet (:meth:`~kaitian.DistributedSampler.claim_batch`):
            right however far the loader draws ahead (workers, prefetching,
            Accelerate), as long as every batch gets one call in the order
            the loader yields them; otherwise pass ``count=len(batch)``.
        total: ``count`` summed over all ranks for the synchronised step.
            Default: exchanged here (a collective on every call; it also
            checks that all ranks are at the same step). With gradient
            accumulation pass the total over the whole window
            (:func:`global_count`) and do not divide the loss by the number
            of micro-batches: the accumulated gradient is then the mean over
            every sample of the window.
        group: the DDP's process group (default: the world).
        sampler: the :class:`kaitian.DistributedSampler` the batch came from:
            its epoch tags the exchange (ranks at different steps are named),
            and a DataLoader whose ``batch_size`` cuts its steps is refused.

    Returns:
        The scaled loss.
    """
    if count is None and sampler is None:
        raise TrainingError(
            "kaitian.scale_loss(loss) needs count= (this rank's samples or tokens in the loss) "
            "or sampler= (the kaitian.DistributedSampler the batch came from)"
        )
    own = _as_float(sampler.claim_batch().size if count is None else count)
    world = _world(group)
    if total is None:
        total = global_count(own, group, sampler)
    total = _as_float(total)
    if total <= 0:
        raise TrainingError(f"scale_loss: the global count is {total}; every step needs samples")
    return loss * (own * world / total)

