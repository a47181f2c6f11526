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
* ``prepare()`` does not shard a DataLoader built on a :class:`kaitian.DistributedSampler`
  again: it wraps it as for one process, so its batches keep kaitian's split,
  are moved to ``accelerator.device`` and the loader's end ends an
  accumulation window (``sync_with_dataloader``) as in stock Accelerate;
  other loaders are prepared by Accelerate as usual (so ``gather_for_metrics``
  on an evaluation loader behaves as without kaitian); ``split_batches=True``
  is refused for kaitian's loader (its batches are per rank already);
* ``gather_for_metrics`` while a kaitian loader is iterated gathers the
  ranks' batches of different sizes (padded to the largest for the
  collective, each rank's part cut back to its own count) and drops the
  samples kaitian's sampler repeated to pad its last step, so every sample
  comes back once, as without kaitian (the batch dimension is dim 0; the
  other dimensions must agree across ranks);
* ``backward(loss, count=None, total=None)`` scales the loss with
  :func:`kaitian.scale_loss` first, given the sampler of the loader being
  iterated (``count`` defaults to the size of the batch the loader yielded
  last: it draws ahead, so the loader records which of the sampler's batches
  it yields; several ``backward`` calls on one batch all count it; stock DDP
  then averages to the exact global-batch mean). With
  ``gradient_accumulation_steps`` and no ``total``, each micro-batch is the
  global mean of its own samples divided by the steps, as Accelerate does in
  one process. ``total="window"`` makes each optimizer step exactly the mean
  over its window's samples: the window's global count comes from kaitian's
  split (short last step and short last window included), with no exchange
  and without drawing the window ahead; use it inside
  ``accelerator.accumulate(model)`` with the default ``sync_with_dataloader``
  (windows start with the loader), or pass ``total`` yourself (the window's
  :func:`kaitian.global_count`).

Tested on CPU ranks in two simulated vendor groups (no accelerator in CI).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import accelerate
import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import InitProcessGroupKwargs, gather_object, recursively_apply

import kaitian  # noqa: F401  registers the "kaitian" backend
from kaitian.errors import TrainingError
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


def _claiming(loader_type: type) -> type:
    """``loader_type`` (Accelerate's prepared loader) that records, as it yields
    each batch, which of its sampler's handed-out batches that is (``kaitian_batch``):
    the loader draws ahead, and a batch may take several ``backward`` calls (a GAN's
    two losses, two models), so neither the last batch drawn nor one claim per
    ``backward`` names the batch being trained."""
    if loader_type not in _CLAIMING:
        def __iter__(self):
            sampler = kaitian_sampler_of(self)
            skipped = getattr(self, "skip_batches", 0)  # drawn, never yielded
            for batch in super(claiming, self).__iter__():
                for _ in range(skipped):
                    sampler.claim_batch()
                skipped = 0
                self.kaitian_batch = sampler.claim_batch()
                yield batch

        claiming = type(f"Kaitian{loader_type.__name__}", (loader_type,), {"__iter__": __iter__})
        _CLAIMING[loader_type] = claiming
    return _CLAIMING[loader_type]


_CLAIMING: dict = {}


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` for heterogeneous ranks (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["kwargs_handlers"] = _init_kaitian(list(kwargs.get("kwargs_handlers") or []))
        if "cpu" not in kwargs and kaitian.device().type == "cpu":
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if kaitian_sampler_of(data_loader) is None:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self.split_batches:
            raise TrainingError(
                "kaitian.accelerate: split_batches=True would cut kaitian's per-rank batches again; "
                "use split_batches=False and DistributedSampler(batch_size=<per-rank batch of an equal split>)")
        # kaitian's split already is the sharding: wrapped as for one process, so
        # Accelerate still sees the loader's end (sync_with_dataloader) and places batches.
        if device_placement is None:
            device_placement = self.device_placement
        prepared = prepare_data_loader(data_loader, self.device, num_processes=1, process_index=0,
                                       split_batches=False, put_on_device=device_placement, rng_types=None,
                                       dispatch_batches=False, non_blocking=self.non_blocking)
        # (Accelerate's loaders answer __class__ with the wrapped DataLoader's)
        object.__dict__["__class__"].__set__(prepared, _claiming(type(prepared)))
        self._dataloaders.append(prepared)
        return prepared

    def gather_for_metrics(self, input_data, use_gather_object=False):
        sampler = kaitian_sampler_of(self.gradient_state.active_dataloader)
        if sampler is None or self.num_processes == 1:
            return super().gather_for_metrics(input_data, use_gather_object)
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if use_gather_object:
            data = gather_object(input_data)
        else:
            data = recursively_apply(self._gather_uneven, input_data)
        repeated = sampler.last_step_padding if self.gradient_state.end_of_dataloader else 0
        if repeated == 0:
            return data
        # the sampler's repeats are the last positions of the step in rank order
        cut = lambda gathered: gathered[: len(gathered) - repeated]  # noqa: E731
        return cut(data) if use_gather_object else recursively_apply(cut, data)

    def _gather_uneven(self, tensor):
        """All ranks' ``tensor`` concatenated along dim 0, whatever each rank's length there."""
        tensor = tensor[None] if tensor.ndim == 0 else tensor
        counts = self.gather(torch.tensor([len(tensor)], device=tensor.device)).tolist()
        most = max(counts)
        padded = torch.cat([tensor, tensor.new_zeros(most - len(tensor), *tensor.shape[1:])])
        parts = self.gather(padded.contiguous()).split(most)
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    def backward(self, loss, count: Optional[Any] = None, total: Optional[Any] = None, **kwargs: Any) -> None:
        sampler = kaitian_sampler_of(self.gradient_state.active_dataloader)
        if isinstance(total, str):
            if total != "window" or sampler is None or count is not None:
                raise TrainingError(
                    f"kaitian.accelerate: backward(loss, total={total!r}) needs total='window', no count= and a "
                    "loader on kaitian's sampler (the window's count comes from its split); "
                    "otherwise pass total=kaitian.global_count(...) over the window")
            batch = self.gradient_state.active_dataloader.kaitian_batch
            count, total = batch.size, self._window_samples(sampler, batch.step)
        elif sampler is not None and count is None:
            count = self.gradient_state.active_dataloader.kaitian_batch.size
        scaled = scale_loss(loss, count=count, total=total, sampler=sampler)
        if total is not None:
            # total spans the whole window already; Accelerate's backward divides
            # by gradient_accumulation_steps again.
            scaled = scaled * self.gradient_accumulation_steps
        super().backward(scaled, **kwargs)

    def _window_samples(self, sampler, step: int) -> int:
        """Samples over all ranks in the accumulation window of ``step``: windows of
        ``gradient_accumulation_steps`` from where the epoch's pass started, the last one
        ending with the loader (Accelerate's ``sync_with_dataloader``)."""
        steps = self.gradient_accumulation_steps
        start = sampler.first_step + (step - sampler.first_step) // steps * steps
        end = min(start + steps, sampler.num_steps)
        if (step + 1 == end) != self.sync_gradients:
            raise TrainingError(
                f"kaitian.accelerate: total='window' puts step {step} in the window of steps {start}-{end - 1}, "
                f"but Accelerate {'does not step' if step + 1 == end else 'steps'} there; call backward inside "
                "accelerator.accumulate(model) with sync_with_dataloader=True, or pass total= yourself")
        return sum(sampler.step_samples(s) for s in range(start, end))
