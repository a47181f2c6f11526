"""Which device this rank computes on, and seeding it.

Under ``kaitianrun`` every worker gets ``KAITIAN_DEVICE_TYPE`` and
``KAITIAN_DEVICE_INDEX`` (the host's index of its device). Under plain
``torchrun`` (or ``mp.spawn``) nothing is set, and the rank falls back to what
torch users expect: the ``LOCAL_RANK``-th accelerator if there is one, else the
CPU.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Optional

import torch

from kaitian.settings import settings
from kaitian.devices.vendors import VENDORS, vendor

__all__ = ["device", "set_device", "local_device_count", "manual_seed", "device_type"]

_log = logging.getLogger(__name__)


def _accelerators() -> list:
    """Vendors other than the CPU that have at least one device here."""
    found = []
    for v in VENDORS.values():
        if v.name == "cpu":
            continue
        try:
            if v.count() > 0:
                found.append(v)
        except Exception:  # a broken vendor plug-in must not break the CPU path
            _log.debug("device count for %s failed", v.name, exc_info=True)
    return found


def device_type() -> str:
    """This rank's vendor device type (``cuda``, ``mlu``, ``cpu``)."""
    chosen = settings().device_type
    if chosen:
        vendor(chosen)  # raises a clear error for an unknown type
        return chosen
    accelerators = _accelerators()
    return accelerators[0].name if accelerators else "cpu"


def _visible_position(visible_env: Optional[str], host_index: int) -> int:
    """Maps a host device index to the index torch sees under the visibility variable.

    The launcher may hide all other devices (``CUDA_VISIBLE_DEVICES=3`` makes
    the host's device 3 torch's ``cuda:0``).
    """
    if not visible_env:
        return host_index
    raw = os.environ.get(visible_env, "").strip()
    if not raw:
        return host_index
    visible = [item.strip() for item in raw.split(",") if item.strip()]
    if str(host_index) in visible:
        return visible.index(str(host_index))
    if len(visible) == 1:
        return 0
    return host_index


def _torch_index(rank: Optional[int] = None) -> Optional[int]:
    kind = device_type()
    if kind == "cpu":
        return None
    v = vendor(kind)
    index = settings().device_index
    if index is not None:
        return _visible_position(v.visible_env, index)
    if rank is None:
        rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = max(1, v.count())
    return rank % count


def device() -> torch.device:
    """The torch device this rank should compute on.

    Returns:
        ``cuda:i`` / ``mlu:i`` for an accelerator rank, ``cpu`` for a CPU slot.
    """
    kind = device_type()
    return torch.device(vendor(kind).torch_device(_torch_index()))


def set_device(rank: Optional[int] = None) -> torch.device:
    """Makes this rank's device current for the process (``torch.cuda.set_device``).

    Args:
        rank: kept for the original API (``set_device(rank)``). Under
            ``kaitianrun`` the launcher already decided the device and ``rank``
            is ignored; otherwise the ``rank``-th local accelerator is used
            (default: ``LOCAL_RANK``).

    Returns:
        The device now current.
    """
    kind = device_type()
    v = vendor(kind)
    v.import_module()
    index = _torch_index(rank)
    if index is not None and v.set_device is not None:
        v.set_device(index)
    return torch.device(v.torch_device(index))


def local_device_count() -> int:
    """How many workers this node runs: one per selected device.

    Under a launcher this is ``LOCAL_WORLD_SIZE``; otherwise the number of
    accelerators on the host (all vendors), or 1 when there is none.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    total = 0
    for v in _accelerators():
        total += v.count()
    return total or 1


def manual_seed(seed: int) -> None:
    """Seeds Python, NumPy and torch on every vendor, and asks for determinism.

    Replaces ``torch.manual_seed`` + ``torch.cuda.manual_seed`` +
    ``cudnn.deterministic = True`` of a single-vendor script.

    Args:
        seed: the seed; use the same on every rank for identical initial models.
    """
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
    except ImportError:
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    for v in _accelerators():
        module = getattr(torch, v.name, None)
        seed_all = getattr(module, "manual_seed_all", None)
        if callable(seed_all):
            seed_all(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
