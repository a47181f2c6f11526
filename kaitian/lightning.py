"""``kaitian.lightning.KaitianStrategy``: PyTorch Lightning's DDP with kaitian's split, weighting and re-balancing.

::

    from kaitian.lightning import KaitianStrategy

    loader = DataLoader(train_set, batch_size=32, shuffle=True)
    trainer = L.Trainer(strategy=KaitianStrategy(), accelerator=kaitian.device().type)
    trainer.fit(module, loader)          # run under kaitianrun (or torchrun)

The same strategy serves a Trainer from ``lightning`` and from
``pytorch_lightning``: the one imported (with both imported, say which:
``KaitianStrategy(package="pytorch_lightning")``). What it changes against
``DDPStrategy``:

* the process group backend is ``"kaitian"``;
* the model is wrapped in :class:`kaitian.DistributedDataParallel`, so the
  gradient is the exact global-batch mean with unequal per-rank batches
  (with ``accumulate_grad_batches`` Lightning divides each micro-batch loss
  by the number of accumulation steps, the convention kaitian's DDP expects);
* the training loader is sharded by kaitian as ``DDPStrategy`` shards it by
  torch's sampler: a plain ``DataLoader(ds, batch_size=B, shuffle=...,
  drop_last=...)`` gets ``batch_sampler=kaitian.DistributedSampler(ds,
  batch_size=B, shuffle=..., drop_last=..., seed=PL_GLOBAL_SEED)``;
  a loader already on a :class:`kaitian.DistributedSampler` is kept; one with
  another sampler, batch sampler or an iterable dataset is refused (kaitian
  cannot split what it does not draw). Validation and test loaders are not
  sharded (each rank sees all of them). The model trains on that sampler
  (:meth:`kaitian.DistributedDataParallel.use_sampler`);
* ``rebalance=True`` (default) wires a :class:`kaitian.Rebalancer` to the
  training loader's sampler (give ``rebalance={...}`` for its arguments);
* under a launcher (kaitianrun, torchrun) the processes are the launcher's:
  ``devices="auto"`` (or any count) gives ``LOCAL_WORLD_SIZE`` processes on
  ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes, each on its own device.

Mixed vendors: Lightning builds one accelerator per process, so each rank
gives the Trainer its own device type (``accelerator=kaitian.device().type``);
precision plugins and strategies that assume the same device type on every
rank (FSDP, DeepSpeed, ``SyncBatchNorm`` on mixed CUDA/MLU) are not covered.
Tested on CPU ranks in two simulated vendor groups (no accelerator in CI).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Dict, Optional, Union

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

import kaitian  # noqa: F401  registers the "kaitian" backend
from kaitian.errors import TrainingError
from kaitian.training.ddp import DistributedDataParallel
from kaitian.training.rebalance import Rebalancer
from kaitian.training.sampler import DistributedSampler, KaitianBatchSampler, kaitian_sampler_of

__all__ = ["KaitianStrategy"]

_PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
_VARIANTS: Dict[str, type] = {}
# DataLoader arguments that decide the batches (kaitian's sampler replaces them).
_BATCHING = {"self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}


def _package(package: Optional[str]) -> str:
    if package is None:
        loaded = [name for name, module in _PACKAGES.items() if module in sys.modules]
        if len(loaded) != 1:
            raise TrainingError(
                f"KaitianStrategy: {'both' if loaded else 'neither of'} lightning and pytorch_lightning "
                "imported; say which Trainer it is for: KaitianStrategy(package='lightning' or 'pytorch_lightning')")
        return loaded[0]
    if package not in _PACKAGES:
        raise TrainingError(f"KaitianStrategy(package={package!r}): use 'lightning' or 'pytorch_lightning'")
    return package


def _variant(package: str) -> type:
    """``KaitianStrategy`` on the ``DDPStrategy`` of ``package``."""
    if package not in _VARIANTS:
        ddp = importlib.import_module(_PACKAGES[package] + ".strategies").DDPStrategy
        _VARIANTS[package] = type("KaitianStrategy", (KaitianStrategy, ddp), {"__module__": __name__})
    return _VARIANTS[package]


def _what_decides_batches(loader: DataLoader) -> Optional[str]:
    """What in ``loader`` other than batch_size/shuffle/drop_last decides its batches, if anything."""
    if type(loader) is not DataLoader:
        return f"class {type(loader).__name__}"
    if isinstance(loader.dataset, IterableDataset):
        return f"iterable dataset {type(loader.dataset).__name__}"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"batch_sampler {type(loader.batch_sampler).__name__}"
    if type(loader.sampler) not in (RandomSampler, SequentialSampler):
        return f"sampler {type(loader.sampler).__name__}"
    return None


def _with_kaitian_sampler(loader: DataLoader, seed: int) -> DataLoader:
    """``loader`` drawing its batches from a kaitian sampler (a TrainingError where it cannot)."""
    what = _what_decides_batches(loader)
    if what is not None:
        raise TrainingError(
            f"KaitianStrategy: the training loader's {what} decides its batches, which kaitian cannot split; "
            "use DataLoader(ds, batch_size=B, shuffle=...) or DataLoader(ds, "
            "batch_sampler=kaitian.DistributedSampler(ds, batch_size=B).batch_sampler())")
    sampler = DistributedSampler(loader.dataset, batch_size=loader.batch_size,
                                 shuffle=isinstance(loader.sampler, RandomSampler),
                                 drop_last=loader.drop_last, seed=seed)
    kept = {name: getattr(loader, name) for name in inspect.signature(DataLoader).parameters
            if name not in _BATCHING and hasattr(loader, name)}
    return DataLoader(loader.dataset, batch_sampler=sampler.batch_sampler(), **kept)


class KaitianStrategy:
    """Lightning's ``DDPStrategy`` for heterogeneous ranks (see the module docstring).

    Args:
        rebalance: ``True`` (default) re-balances the training loader's split
            with :class:`kaitian.Rebalancer` defaults; a dict gives its
            arguments; ``False`` keeps the capability split.
        process_group_backend: default ``"kaitian"``.
        package: ``"lightning"`` or ``"pytorch_lightning"`` (default: the one imported).
        **kwargs: as ``DDPStrategy`` (and torch's DDP).
    """

    strategy_name = "kaitian"

    def __new__(cls, *args: Any, package: Optional[str] = None, **kwargs: Any):
        if cls is KaitianStrategy:
            cls = _variant(_package(package))
        return super().__new__(cls)

    def __init__(
        self,
        rebalance: Union[bool, Dict[str, Any]] = True,
        process_group_backend: Optional[str] = "kaitian",
        package: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, **kwargs)
        self._rebalance = rebalance
        self.rebalancer: Optional[Rebalancer] = None

    def set_world_ranks(self) -> None:
        # The launcher made the processes: one per rank, each on its own device,
        # whatever `devices` counted on this rank's vendor.
        if self.cluster_environment is not None and self.cluster_environment.creates_processes_externally:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", len(self.parallel_devices or [None])))
            world = int(os.environ.get("WORLD_SIZE", local * self.num_nodes))
            if len(self.parallel_devices or []) != local or self.num_nodes * local != world:
                self.parallel_devices = [kaitian.device()] * local
                self.num_nodes = world // local
        super().set_world_ranks()

    def _setup_model(self, model):
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(),
                                       **self._ddp_kwargs)

    def setup(self, trainer) -> None:
        # Lightning's own sampler injection would shard kaitian's loaders again;
        # process_dataloader shards the training loader instead.
        connector = getattr(trainer, "_accelerator_connector", None)
        if connector is not None and hasattr(connector, "use_distributed_sampler"):
            connector.use_distributed_sampler = False
        super().setup(trainer)

    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        training = trainer is not None and str(getattr(trainer.state.stage, "value", "")) == "train"
        if training and isinstance(dataloader, DataLoader) and kaitian_sampler_of(dataloader) is None:
            dataloader = _with_kaitian_sampler(dataloader, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
        sampler = kaitian_sampler_of(dataloader)
        model = self.model
        if training and sampler is not None and isinstance(model, DistributedDataParallel):
            model.use_sampler(sampler)
            if (
                self._rebalance
                and self.rebalancer is None
                and isinstance(getattr(dataloader, "batch_sampler", None), KaitianBatchSampler)
            ):
                options = self._rebalance if isinstance(self._rebalance, dict) else {}
                self.rebalancer = Rebalancer(sampler, model, **options)
        return super().process_dataloader(dataloader)
