"""The one exchange the training helpers use: each rank writes its slot, then sum.

Every rank fills its own row of a zero matrix and the matrix is all-reduced
with a sum, so the result is bit-identical on every rank (``x + 0`` is exact)
and every rank derives the same decision from it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from kaitian.backend import BACKEND_NAME

__all__ = ["gather_per_rank", "rows"]


def gather_per_rank(
    values: Sequence[float],
    group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
    dtype: torch.dtype = torch.float64,
    async_op: bool = False,
):
    """Every rank's ``values`` (the same length everywhere), through one all-reduce.

    Over backend ``kaitian`` the exchange stays in host memory (every rank may
    pass CPU tensors): no device copy, nothing that waits for the device.

    Args:
        values: this rank's numbers.
        group: the process group (default: the world).
        device: this rank's device, where other backends need the exchange
            tensor (default: :func:`kaitian.device`).
        dtype: float64 keeps integers up to 2**53 exact; int64 for counts
            (exact on every vendor: CNCL has no float64).
        async_op: return ``(work, tensor)`` instead of waiting.

    Returns:
        ``[[rank 0's values], [rank 1's values], ...]``, or ``(work, tensor)``
        with ``async_op`` (read it with :func:`rows`).
    """
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if initialized else 1
    rank = dist.get_rank(group) if initialized else 0
    row = torch.tensor([v if dtype.is_floating_point else int(v) for v in values], dtype=dtype)
    if world == 1 and not async_op:  # nothing to exchange: no tensor on the device, nothing waits for it
        return [row.tolist()]
    if world > 1 and dist.get_backend(group) == BACKEND_NAME:
        device = torch.device("cpu")
    elif device is None:
        from kaitian.devices.rank import device as rank_device

        device = rank_device()
    slots = torch.zeros(world, len(values), dtype=dtype, device=device)
    if device.type == "cpu":
        slots[rank] = row
    else:  # pinned and non-blocking: a pageable copy would wait for the device's queue
        slots[rank].copy_(row.pin_memory(), non_blocking=True)
    work = dist.all_reduce(slots, group=group, async_op=async_op) if world > 1 else None
    if async_op:
        return work, slots
    return rows(slots)


def rows(slots: torch.Tensor) -> List[List[float]]:
    """The exchanged matrix as one list of numbers per rank."""
    return slots.cpu().tolist()
