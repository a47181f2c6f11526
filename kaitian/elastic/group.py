"""The default process group of one generation: built, told apart from a script error, torn down."""

from __future__ import annotations

import gc
import logging
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from kaitian import _torch as _te

__all__ = ["form", "tear_down", "loss_of", "workers_store"]

_log = logging.getLogger(__name__)


def workers_store(timeout: float):
    """A client of the workers' store (``MASTER_ADDR:MASTER_PORT``, served by node 0's agent)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout))


def form(store, prefix: str, rank: int, world: int, timeout: float, setup_timeout: float) -> None:
    """Creates the default ``kaitian`` group of ``world`` ranks on the store keys under ``prefix``.

    Args:
        store: the workers' store.
        prefix: this generation's keys.
        rank, world: this rank and the group's size.
        timeout: the group's timeout for every op (a silent peer is lost after it).
        setup_timeout: how long building the group may wait for the others
            (at launch workers start seconds apart).

    ``RANK`` / ``WORLD_SIZE`` follow, so code that reads them sees this generation.
    """
    dist.init_process_group("kaitian", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(timeout, setup_timeout)))
    dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).set_timeout(
        timedelta(seconds=timeout))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)


def _first_failure(group: Optional[dist.ProcessGroup] = None) -> str:
    """A kaitian group's first failure (default: the default group's; "" while it is healthy, or without one)."""
    if not dist.is_initialized():
        return ""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cpu"))
    except RuntimeError:
        return ""
    first = getattr(backend, "first_failure", None)
    return first() if first is not None else ""


def loss_of(exc: BaseException, training_group: Optional[dist.ProcessGroup] = None) -> Optional[str]:
    """Why ``exc`` means a peer was lost (the group's first failure), or ``None`` for any other error.

    Fail-stop breaks the group on every rank after any failure in a collective;
    an error that left it healthy (a bug in the script) is not a loss. The
    ranks that train may exchange in a subgroup (``training_group``: others
    are benched); its failure counts too.
    """
    failure = _first_failure() or (_first_failure(training_group) if training_group is not None else "")
    if failure:
        return failure
    seen = set()
    while exc is not None and id(exc) not in seen:  # a store error while agreeing or forming
        seen.add(id(exc))
        if isinstance(exc, dist.DistError):
            return str(exc)
        exc = exc.__cause__ or exc.__context__
    return None


def tear_down(collect: bool = False, reforming: bool = False) -> None:
    """Drops the default group; the caller dropped its models first.

    A broken group is aborted (vendor communicators such as NCCL's are
    aborted, not destroyed, which could wait for a lost peer), and so is a
    group left for the next generation: its sends still in flight are void
    (a destroyed kaitian group delivers them first, and a lost or stopped
    receiver would hold it up to the op timeout). A healthy group at the
    end is destroyed. Either stops every wait within milliseconds.

    Args:
        collect: a dropped model is still alive (held by reference cycles):
            collect it before its group (a full collection takes most of a
            second in a process that imported torch, so only then).
        reforming: the group is left for the next generation.
    """
    if collect:
        gc.collect()
    if not dist.is_initialized():
        return
    try:
        if reforming or _first_failure():
            _te.abort_process_groups()
        else:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 (a broken group may complain; it is gone either way)
        _log.warning("kaitian elastic: dropping the process group: %s", exc)
