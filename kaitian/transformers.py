"""The Hugging Face ``transformers`` Trainer with kaitian: ``KaitianTrainer``.

::

    from kaitian.transformers import KaitianTrainer

    trainer = KaitianTrainer(model=model, args=TrainingArguments(...), train_dataset=train_set)
    trainer.train()                      # run under kaitianrun (or torchrun)

A ``Trainer`` subclass:

* under a launcher, importing this module initialises the process group
  with backend ``"kaitian"``, so ``TrainingArguments`` (which sets up the
  devices and the group when built; its ``ddp_backend`` accepts only
  Accelerate's names) and the Trainer find it ready, in whichever order
  they are built; a group that exists already with another backend (created
  before the import) is refused with a line;
* the training loader is ``DataLoader(train_dataset,
  batch_sampler=kaitian.DistributedSampler(...).batch_sampler())`` with the
  Trainer's collator and ``per_device_train_batch_size`` as the per-rank batch
  of an equal split; it is not passed through Accelerate (which would shard
  it again), and ``set_epoch`` is called at every epoch;
* ``compute_loss`` scales each rank's loss with :func:`kaitian.scale_loss`
  (count: the batch's first tensor's dim 0, or ``count_fn(inputs)``, e.g.
  the number of non-padding label tokens) and the training sampler, so
  torch's DDP averages to the exact global-batch mean;
* ``rebalance`` is not wired in: the Trainer wraps the model in torch's DDP,
  which kaitian's :class:`kaitian.Rebalancer` cannot time; the split follows
  the capabilities from ``kaitian init``.

With ``gradient_accumulation_steps > 1`` the Trainer divides each
micro-batch's loss by the step count, which is exact when the micro-batches'
global totals are equal (the sampler's full steps); the short last step of an
epoch inside an accumulation window is weighted as its own micro-batch.

Tested on CPU ranks in two simulated vendor groups (no accelerator in CI).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

import kaitian  # noqa: F401  registers the "kaitian" backend
from kaitian.errors import TrainingError
from kaitian.training.ddp import _count_samples
from kaitian.training.sampler import DistributedSampler
from kaitian.training.weighting import scale_loss

__all__ = ["KaitianTrainer"]


def _init_kaitian() -> None:
    """The kaitian process group under a launcher, before anything else creates one.

    ``TrainingArguments(...)`` already sets up the devices (and the process
    group, through Accelerate) when it is built, before any Trainer exists;
    importing this module first is what gets backend kaitian there.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("kaitian")


_init_kaitian()


class _SetEpoch(TrainerCallback):
    def __init__(self, trainer: "KaitianTrainer") -> None:
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = self.trainer.kaitian_sampler
        if sampler is not None:
            sampler.set_epoch(int(state.epoch or 0))


class KaitianTrainer(Trainer):
    """``transformers.Trainer`` for heterogeneous ranks (see the module docstring).

    Args:
        *args: as ``Trainer``.
        capabilities: per-rank samples/s for the split (default: ``kaitian init``'s).
        count_fn: ``fn(inputs) -> int``: what each rank's loss is a mean over
            (default: the batch size).
        **kwargs: as ``Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        capabilities: Optional[Sequence[float]] = None,
        count_fn: Optional[Callable[[dict], Any]] = None,
        **kwargs: Any,
    ) -> None:
        _init_kaitian()
        if dist.is_initialized() and dist.get_backend() != "kaitian":
            raise TrainingError(
                f"KaitianTrainer: the process group was created with backend {dist.get_backend()!r} "
                "before kaitian.transformers was imported; import it before building TrainingArguments")
        self._kt_capabilities = capabilities
        self._kt_count = count_fn or (lambda inputs: _count_samples((), dict(inputs)))
        self.kaitian_sampler: Optional[DistributedSampler] = None
        super().__init__(*args, **kwargs)
        self.add_callback(_SetEpoch(self))

    def get_train_dataloader(self) -> DataLoader:
        if self.kaitian_sampler is None:
            self.kaitian_sampler = DistributedSampler(
                self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                seed=self.args.seed, drop_last=self.args.dataloader_drop_last,
                capabilities=self._kt_capabilities,
            )
        return DataLoader(
            self.train_dataset, batch_sampler=self.kaitian_sampler.batch_sampler(),
            collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        count = self._kt_count(inputs)
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if return_outputs:
            loss, outputs = result
            return scale_loss(loss, count=count, sampler=self.kaitian_sampler), outputs
        return scale_loss(result, count=count, sampler=self.kaitian_sampler)
