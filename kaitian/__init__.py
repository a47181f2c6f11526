"""kaitian: heterogeneous data-parallel training for PyTorch.

``import kaitian`` registers the ``"kaitian"`` distributed backend. The rest of
the public API is loaded on first use, so the launcher stays quick to start.
"""

from __future__ import annotations

import importlib
from typing import Any

from kaitian.backend import register_backend as _register_backend

from kaitian.version import __version__

_register_backend()

# public name -> module that defines it
_LAZY = {
    "device": "kaitian.devices.rank",
    "set_device": "kaitian.devices.rank",
    "local_device_count": "kaitian.devices.rank",
    "manual_seed": "kaitian.devices.rank",
    "DistributedSampler": "kaitian.training.sampler",
    "optimize_batch_size": "kaitian.training.sampler",
    "DistributedDataParallel": "kaitian.training.ddp",
    "Rebalancer": "kaitian.training.rebalance",
    "scale_loss": "kaitian.training.weighting",
    "global_count": "kaitian.training.weighting",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kaitian' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
