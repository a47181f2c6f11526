"""Visibility variables (``CUDA_VISIBLE_DEVICES``, ``MLU_VISIBLE_DEVICES``) and torch ordinals.

On the host, a visibility variable limits which devices kaitian may use:
entries are physical indices or UUIDs (a unique ``GPU-…`` prefix is enough),
read as CUDA reads them (an entry that names no device ends the list). The
devices keep their physical index (``cuda:2`` stays ``cuda:2``).

What a worker sees is decided once, by :func:`worker_visibility` (its runtime
calls it with the container's view where there is one). In the worker, torch
numbers the devices it sees from 0: :func:`torch_ordinal` turns
``KAITIAN_DEVICE_INDEX`` (physical) into that ordinal.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

from kaitian.devices.device import ContainerDevices, Device, WorkerDevice
from kaitian.devices.vendors import VENDORS
from kaitian.errors import DeviceSelectionError
from kaitian.settings import Settings

__all__ = ["parse_visible", "visible_devices", "torch_ordinal", "worker_visibility"]

# The vendor whose visibility torchrun's --virtual-local-rank narrows to one device.
_VIRTUAL_LOCAL_RANK_VENDOR = "cuda"


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
    listed = Settings.from_env(env).visible_indices
    if listed:
        if device.index in listed:
            return listed.index(device.index)
        raise DeviceSelectionError(
            f"KAITIAN_DEVICE_INDEX={device.index} is not among this container's devices "
            f"(KAITIAN_VISIBLE_INDICES={','.join(map(str, listed))})"
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


def worker_visibility(
    device: WorkerDevice,
    *,
    hide_other_vendors: bool = False,
    own_device_only: bool = False,
    container: Optional[ContainerDevices] = None,
) -> Dict[str, str]:
    """The visibility variables a worker gets: what it sees of each vendor's devices.

    Its own vendor: in a container, the container's devices in the container's
    order (and ``KAITIAN_VISIBLE_INDICES``, their physical indices); on the host,
    what the agent sees (nothing is written). With ``own_device_only``
    (torchrun's ``--virtual-local-rank``, which narrows ``CUDA_VISIBLE_DEVICES``)
    a CUDA worker sees only its own GPU. Another vendor's devices are hidden
    (``""``) with ``hide_other_vendors``, else left as the agent sees them.

    Args:
        device: the worker's device (physical index).
        hide_other_vendors: hide every other vendor's devices (``--nproc-auto``).
        own_device_only: ``--virtual-local-rank``.
        container: the worker's container's devices, or ``None`` on the host.
    """
    env: Dict[str, str] = {}
    for v in VENDORS.values():
        if v.visible_env is None:
            continue
        if v.name != device.type:
            if hide_other_vendors:
                env[v.visible_env] = ""
            continue
        own_only = own_device_only and v.name == _VIRTUAL_LOCAL_RANK_VENDOR
        if container is None:
            if own_only:
                env[v.visible_env] = device.uuid or str(device.index)
            continue
        env.update(container.env)
        indices = container.visible_indices
        if own_only and len(indices) > 1 and device.index in indices:
            env[v.visible_env] = parse_visible(container.env[v.visible_env])[container.index_map[device.index]]
            indices = (device.index,)
        env.update(Settings(visible_indices=indices).to_env())
    return env
