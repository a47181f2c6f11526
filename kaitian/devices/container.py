"""What a container needs to see exactly a set of host devices: the docker runtime asks here."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from kaitian.devices.device import ContainerDevices, WorkerDevice
from kaitian.devices.vendors import vendor

__all__ = ["ContainerDevices", "container_devices"]


def container_devices(
    kind: str, devices: Sequence[WorkerDevice], present_nodes: Optional[Iterable[str]] = None
) -> ContainerDevices:
    """The device requests, device nodes and environment for one container.

    Args:
        kind: the device type of every device (one vendor per container).
        devices: the workers' devices (physical indices, UUIDs where known).
        present_nodes: device nodes on this host (default: look in ``/dev``).

    Returns:
        Empty for a type without hardware (CPU).

    Raises:
        UnknownVendorError: unknown type.
        DeviceSelectionError: a device the container needs is missing here.
    """
    hook = vendor(kind).container
    if hook is None:
        return ContainerDevices()
    return hook(devices, present_nodes)
