"""``kaitian.lightning.KaitianStrategy``: PyTorch Lightning's DDP with kaitian's split, weighting and re-balancing.

::

    import kaitian
    from kaitian.lightning import KaitianStrategy

    sampler = kaitian.DistributedSampler(train_set, batch_size=32)
    loader = DataLoader(train_set, batch_sampler=sampler.batch_sampler())
    trainer = L.Trainer(strategy=KaitianStrategy(), accelerator=kaitian.device().type,
                        devices=int(os.environ["LOCAL_WORLD_SIZE"]))
    trainer.fit(module, loader)          # run under kaitianrun (or torchrun)

What the strategy changes against ``DDPStrategy``:

* the process group backend is ``"kaitian"``;
* the model is wrapped in :class:`kaitian.DistributedDataParallel`, so the
  gradient is the exact global-batch mean with unequal per-rank batches
  (with ``accumulate_grad_batches`` Lightning divides each micro-batch loss
  by the number of accumulation steps, the convention kaitian's DDP expects,
  so each step is the exact mean over its window; tested through Lightning);
* Lightning does not re-shard the data: a loader built on a
  :class:`kaitian.DistributedSampler` (``sampler=`` or
  ``batch_sampler=sampler.batch_sampler()``) is kept as it is;
* ``rebalance=True`` (default) wires a :class:`kaitian.Rebalancer` to the
  training loader's sampler (give ``rebalance={...}`` for its arguments).

Mixed vendors: Lightning builds one accelerator per process, so each rank
gives the Trainer its own device type (``accelerator=kaitian.device().type``)
under ``kaitianrun``; precision plugins and strategies that assume the same
device type on every rank (FSDP, DeepSpeed, ``SyncBatchNorm`` conversion on
mixed CUDA/MLU) are outside what this strategy covers. Tested here on CPU
ranks in two simulated vendor groups only (no accelerator in CI).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

from lightning.pytorch.strategies import DDPStrategy

import kaitian  # noqa: F401  registers the "kaitian" backend
from kaitian.training.ddp import DistributedDataParallel
from kaitian.training.rebalance import Rebalancer
from kaitian.training.sampler import KaitianBatchSampler, kaitian_sampler_of

__all__ = ["KaitianStrategy"]


class KaitianStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` for heterogeneous ranks (see the module docstring).

    Args:
        rebalance: ``True`` (default) re-balances the training loader's split
            with :class:`kaitian.Rebalancer` defaults; a dict gives its
            arguments; ``False`` keeps the capability split.
        process_group_backend: default ``"kaitian"``.
        **kwargs: as ``DDPStrategy`` (and torch's DDP).
    """

    strategy_name = "kaitian"

    def __init__(
        self,
        rebalance: Union[bool, Dict[str, Any]] = True,
        process_group_backend: Optional[str] = "kaitian",
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, **kwargs)
        self._rebalance = rebalance
        self.rebalancer: Optional[Rebalancer] = None

    def _setup_model(self, model):
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(),
                                       **self._ddp_kwargs)

    def setup(self, trainer) -> None:
        # Lightning wraps a loader whose ``.sampler`` is not a DistributedSampler
        # (a batch_sampler= loader) in its own sampler; kaitian's loaders must stay.
        connector = getattr(trainer, "_accelerator_connector", None)
        if connector is not None and hasattr(connector, "use_distributed_sampler"):
            connector.use_distributed_sampler = False
        super().setup(trainer)

    def process_dataloader(self, dataloader: Any) -> Any:
        sampler = kaitian_sampler_of(dataloader)
        model = self.model
        if (
            sampler is not None
            and self._rebalance
            and self.rebalancer is None
            and isinstance(model, DistributedDataParallel)
            and model.training
            and isinstance(getattr(dataloader, "batch_sampler", None), KaitianBatchSampler)
        ):
            options = self._rebalance if isinstance(self._rebalance, dict) else {}
            self.rebalancer = Rebalancer(sampler, model, **options)
        return super().process_dataloader(dataloader)
