"""Visibility variables (``CUDA_VISIBLE_DEVICES``, ``MLU_VISIBLE_DEVICES``) and torch ordinals.

On the host, a visibility variable limits which devices kaitian may use:
entries are physical indices or UUIDs (a unique ``GPU-…`` prefix is enough),
read as CUDA reads them (an entry that names no device ends the list). The
devices keep their physical index (``cuda:2`` stays ``cuda:2``).

In a worker, torch numbers the devices it sees from 0: :func:`torch_ordinal`
turns ``KAITIAN_DEVICE_INDEX`` (physical) into that ordinal.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence

from kaitian.devices.device import Device, WorkerDevice
from kaitian.errors import DeviceSelectionError

__all__ = ["VISIBLE_INDICES_ENV", "parse_visible", "visible_devices", "torch_ordinal"]

# Set by a container runtime: the physical indices of the devices the container
# sees, in the container's order (its visibility variable may hold UUIDs or
# renumbered indices, neither of which names the host's index).
VISIBLE_INDICES_ENV = "KAITIAN_VISIBLE_INDICES"


def parse_visible(raw: str) -> List[str]:
    """The entries of a visibility variable (``"0, 2"`` -> ``["0", "2"]``)."""
    return [item.strip() for item in raw.split(",") if item.strip()]


def _names(entry: str, index: int, uuid: Optional[str]) -> bool:
    """Whether a visibility entry names this device (index, UUID or a UUID prefix)."""
    if entry.isdigit():
        return int(entry) == index
    return bool(uuid) and len(entry) > 4 and uuid.lower().startswith(entry.lower())


def visible_devices(devices: Sequence[Device], raw: Optional[str]) -> List[Device]:
    """The devices a host visibility variable leaves, in its order.

    Args:
        devices: one vendor's devices, physical indices.
        raw: the variable's value; ``None`` (unset) leaves every device.

    Returns:
        The visible devices, physical indices unchanged.
    """
    if raw is None:
        return list(devices)
    chosen: List[Device] = []
    for entry in parse_visible(raw):
        match = [d for d in devices if _names(entry, d.index, d.uuid)]
        if len(match) != 1:
            break  # as CUDA: an entry that names no (single) device ends the list
        if match[0] not in chosen:
            chosen.append(match[0])
    return chosen


def torch_ordinal(device: WorkerDevice, visible_env: Optional[str], env: Mapping[str, str]) -> int:
    """The ordinal torch gives a worker's device, from what the worker sees.

    Rules, in order: ``KAITIAN_VISIBLE_INDICES`` (set in containers) lists the
    physical indices in torch's order; else the vendor's visibility variable,
    whose entry for the device (its index or UUID) is at the ordinal (a single
    entry is ordinal 0); else (nothing hidden) the physical index itself.

    Raises:
        DeviceSelectionError: the worker cannot see its device.
    """
    indices = env.get(VISIBLE_INDICES_ENV)
    if indices:
        listed = parse_visible(indices)
        if str(device.index) in listed:
            return listed.index(str(device.index))
        raise DeviceSelectionError(
            f"KAITIAN_DEVICE_INDEX={device.index} is not among this container's devices "
            f"({VISIBLE_INDICES_ENV}={indices})"
        )
    raw = env.get(visible_env) if visible_env else None
    if raw is None:
        return device.index
    entries = parse_visible(raw)
    for position, entry in enumerate(entries):
        if _names(entry, device.index, device.uuid):
            return position
    if len(entries) == 1:
        return 0  # the launcher hid every other device (--virtual-local-rank)
    raise DeviceSelectionError(
        f"{device.type} device {device.index} is not visible to this worker ({visible_env}={raw}); "
        f"leave {visible_env} to kaitianrun or include the device"
    )
