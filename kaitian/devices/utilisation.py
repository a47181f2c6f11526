"""Accelerator utilisation, for ``kaitianrun --monitor``: each vendor's utilisation hook."""

from __future__ import annotations

from typing import Dict, Iterable

from kaitian.devices.vendors import VENDORS

__all__ = ["device_utilisation"]


def device_utilisation(device_types: Iterable[str]) -> Dict[str, float]:
    """``{"cuda:0": percent, ...}`` (physical indices) for the devices of these types (empty where unknown)."""
    found: Dict[str, float] = {}
    for kind in set(device_types):
        v = VENDORS.get(kind)
        if v is None or v.utilisation is None:
            continue
        try:
            readings = v.utilisation()
        except Exception:  # the monitor must never take the job down
            continue
        found.update({f"{kind}:{index}": percent for index, percent in readings.items()})
    return found
