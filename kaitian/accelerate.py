"""Hugging Face Accelerate with kaitian: backend ``"kaitian"``, kaitian's sampler kept, exact weighting.

::

    from accelerate.utils import InitProcessGroupKwargs
    import kaitian
    from kaitian.accelerate import Accelerator

    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="kaitian")])
    sampler = kaitian.DistributedSampler(train_set, batch_size=32)
    loader = DataLoader(train_set, batch_sampler=sampler.batch_sampler())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(loss_fn(model(x), y))     # weighted: exact global-batch mean
        optimizer.step()

:class:`Accelerator` is ``accelerate.Accelerator`` with three changes:

* backend ``"kaitian"`` is accepted (Accelerate checks backends against its
  own list): the process group is initialised with kaitian before
  Accelerate looks, so Accelerate finds it ready; without an
  ``InitProcessGroupKwargs`` a multi-process run gets backend kaitian too.
  On a CPU rank ``cpu=True`` is implied (Accelerate otherwise sees no
  distributed setup on a host without accelerators);
* ``prepare()`` leaves a DataLoader built on a :class:`kaitian.DistributedSampler`
  as it is (Accelerate would shard kaitian's batches again); batches are not
  moved for you - call ``.to(accelerator.device)``;
* ``backward(loss, count=None, total=None)`` scales the loss with
  :func:`kaitian.scale_loss` first (stock DDP then averages to the exact
  global-batch mean). With ``gradient_accumulation_steps`` and micro-batches
  whose global totals differ, pass ``total`` (see :func:`kaitian.scale_loss`).

Tested on CPU ranks in two simulated vendor groups (no accelerator in CI).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import accelerate
import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs

import kaitian  # noqa: F401  registers the "kaitian" backend
from kaitian.training.sampler import kaitian_sampler_of
from kaitian.training.weighting import scale_loss

__all__ = ["Accelerator"]


def _init_kaitian(handlers: list) -> list:
    """Initialises the kaitian process group when asked for (or multi-process); returns the handlers
    with backend "kaitian" taken out, so that Accelerate's own check does not see it."""
    out, asked, options = [], False, {}
    for handler in handlers:
        if isinstance(handler, InitProcessGroupKwargs) and handler.backend == "kaitian":
            asked = True
            options = {k: v for k, v in (("init_method", handler.init_method), ("timeout", handler.timeout))
                       if v is not None}
            handler = dataclasses.replace(handler, backend=InitProcessGroupKwargs().backend)
        out.append(handler)
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if (asked or multi) and not dist.is_initialized():
        dist.init_process_group("kaitian", **options)
    return out


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` for heterogeneous ranks (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["kwargs_handlers"] = _init_kaitian(list(kwargs.get("kwargs_handlers") or []))
        if "cpu" not in kwargs and kaitian.device().type == "cpu":
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if kaitian_sampler_of(data_loader) is not None:
            return data_loader  # kaitian's split already is the sharding
        return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)

    def backward(self, loss, count: Optional[Any] = None, total: Optional[Any] = None, **kwargs: Any) -> None:
        super().backward(scale_loss(loss, count=count, total=total), **kwargs)
