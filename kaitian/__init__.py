"""kaitian: heterogeneous data-parallel training for PyTorch.

``import kaitian`` registers the ``"kaitian"`` distributed backend (after
installing the fake MLUs of ``KAITIAN_FAKE_ACCELERATOR=mlu:N``, if set). The rest of
the public API is loaded on first use, so the launcher stays quick to start.
"""

from __future__ import annotations

import importlib
from typing import Any

from kaitian.backend import register_backend as _register_backend
from kaitian.devices.vendors import cambricon as _cambricon
from kaitian.errors import SettingError as _SettingError

from kaitian.version import __version__

try:  # KAITIAN_FAKE_ACCELERATOR: before the backend learns the device types
    _cambricon.install_fake()
except (_SettingError, ImportError) as _e:
    raise SystemExit(f"kaitian: {_e}") from None
_register_backend()

# public name -> module that defines it
_LAZY = {
    "device": "kaitian.devices.rank",
    "set_device": "kaitian.devices.rank",
    "local_device_count": "kaitian.devices.rank",
    "manual_seed": "kaitian.devices.rank",
    "DistributedSampler": "kaitian.training.sampler",
    "optimize_batch_size": "kaitian.training.split",
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
