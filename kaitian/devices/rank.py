"""Which device this rank computes on, and seeding it.

Under ``kaitianrun`` every worker gets ``KAITIAN_DEVICE_TYPE`` and
``KAITIAN_DEVICE_INDEX`` (the device's *physical* index on the host, as
``kaitian devices`` and ``nvidia-smi`` number it; ``KAITIAN_DEVICE_UUID`` too
where known). torch numbers what the worker can see from 0, so the ordinal is
worked out from the worker's visibility (:func:`kaitian.devices.visible.torch_ordinal`).
Under plain ``torchrun`` (or ``mp.spawn``) nothing is set, and the rank falls
back to what torch users expect: the ``LOCAL_RANK``-th accelerator if there is
one, else the CPU.

:func:`rank_device` is the one answer to "which device is this rank on"; the
backend's rank record and :func:`device` both use it.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Iterator, Mapping, Optional

import torch

from kaitian.devices.device import WorkerDevice
from kaitian.devices.vendors import VENDORS, Vendor, vendor
from kaitian.devices.visible import torch_ordinal
from kaitian.settings import Settings

__all__ = [
    "device", "set_device", "local_device_count", "manual_seed", "device_type", "rank_device", "torch_device_of",
]

_log = logging.getLogger(__name__)


def _accelerators() -> Iterator[Vendor]:
    """Vendors other than the CPU that torch sees at least one device of, in table order.

    Lazy: a vendor's plug-in (``torch_mlu``, with its global monkeypatches) is
    imported only when no vendor before it has a device.
    """
    for v in VENDORS.values():
        if v.name == "cpu":
            continue
        try:
            if v.count() > 0:
                yield v
        except Exception:  # a broken vendor plug-in must not break the CPU path
            _log.debug("device count for %s failed", v.name, exc_info=True)


def rank_device(env: Optional[Mapping[str, str]] = None, rank: Optional[int] = None) -> WorkerDevice:
    """This rank's device: the launcher's (``KAITIAN_DEVICE_*``), else inferred.

    Inferred (no launcher): the first vendor in table order torch sees a device
    of, device ``KAITIAN_DEVICE_INDEX`` if set, else ``rank % count`` (``rank``
    defaults to ``LOCAL_RANK``); the index is then torch's ordinal, as nothing
    physical is known. Else the CPU.

    Raises:
        UnknownVendorError: ``KAITIAN_DEVICE_TYPE`` names no known type.
    """
    env = os.environ if env is None else env
    s = Settings.from_env(env)
    if s.device is not None:
        vendor(s.device.type)  # raises a clear error for an unknown type
        return s.device
    v = next(_accelerators(), None)
    if v is None:
        return WorkerDevice("cpu", 0, s.group or "cpu")
    if s.device_index is not None:
        index = s.device_index
    else:
        index = (int(env.get("LOCAL_RANK", "0") or 0) if rank is None else rank) % max(1, v.count())
    return WorkerDevice(v.name, index, s.group or v.name)


def torch_device_of(dev: WorkerDevice, env: Optional[Mapping[str, str]] = None) -> str:
    """The torch device string for a device given by physical index (an inventory's,
    the launcher's), as this process sees it. A rank's own device is :func:`device`'s:
    one inferred under plain ``torchrun`` carries torch's ordinal, not a physical index.

    Raises:
        DeviceSelectionError: this process cannot see the device.
    """
    v = vendor(dev.type)
    if dev.type == "cpu":
        return v.torch_device()
    return v.torch_device(torch_ordinal(dev, v.visible_env, os.environ if env is None else env))


def device_type() -> str:
    """This rank's vendor device type (``cuda``, ``mlu``, ``cpu``)."""
    return rank_device().type


def _torch_index(rank: Optional[int] = None) -> Optional[int]:
    """This rank's torch ordinal (``None`` on the CPU): the one place that decides
    which kind of index the rank's device carries (the launcher's: physical;
    inferred: torch's ordinal already)."""
    env = os.environ
    dev = rank_device(env, rank)
    if dev.type == "cpu":
        return None
    if Settings.from_env(env).device is None:
        return dev.index  # inferred: already torch's ordinal
    return torch_ordinal(dev, vendor(dev.type).visible_env, env)


def device() -> torch.device:
    """The torch device this rank should compute on.

    Returns:
        ``cuda:i`` / ``mlu:i`` for an accelerator rank, ``cpu`` for a CPU slot.
    """
    return torch.device(vendor(device_type()).torch_device(_torch_index()))


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
