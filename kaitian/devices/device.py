"""What a device is, in the one vocabulary used from host planning to the backend.

``type`` is the device type (``cuda``, ``mlu``, ``cpu``: ``KAITIAN_DEVICE_TYPE``)
and ``index`` is the device's *physical* index on its host: the number
``nvidia-smi`` / ``cnmon`` / ``kaitian devices`` show, which ``USE_<VENDOR>``
and ``--devices`` select and which ``KAITIAN_DEVICE_INDEX`` carries (CPU: the
slot index). The index torch uses inside a worker (its ordinal) depends on
what the worker can see and is worked out there (:mod:`kaitian.devices.visible`).

- :class:`Device`: one entry of a host's inventory (with name, memory, cores).
- :class:`WorkerDevice`: the device one worker runs on and its kaitian group;
  the node's workers, the rendezvous inventory and the backend's rank
  record all hold this one dataclass.
- :class:`ContainerDevices`: what a container needs to see a set of devices.

Every other devices module builds on this one; it needs nothing of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Tuple


__all__ = ["Device", "WorkerDevice", "ContainerDevices"]


@dataclass
class Device:
    """One device of this host.

    Attributes:
        type: device type (``cuda``, ``mlu``, ``cpu``).
        index: the device's physical index on this host (CPU: the slot index).
        name: product name (CPU: the cores it holds).
        memory_bytes: device memory, if known.
        bus_id: PCI bus id, lower case ``dddd:bb:dd.f`` (CPU: ``numa<N>``), if known.
        link: host link (e.g. ``PCIe4 x16``), if known.
        cpus: cores a worker on this device is pinned to (CPU slots; host
            cores near the device for accelerators, where known).
        capability: measured samples/s from ``kaitian init``, if known.
        uuid: the vendor's device UUID (``GPU-…``), if known.
        source: where discovery found it (``nvml``, ``nvidia-smi``, ``sysfs``, …).
    """

    type: str
    index: int
    name: str
    memory_bytes: Optional[int] = None
    bus_id: Optional[str] = None
    link: Optional[str] = None
    cpus: Tuple[int, ...] = field(default=())
    capability: Optional[float] = None
    uuid: Optional[str] = None
    source: Optional[str] = None

    @property
    def key(self) -> str:
        """``"<type>:<index>"``: the key used by ``kaitian init`` and ``--devices``."""
        return f"{self.type}:{self.index}"

    def worker_device(self, group: Optional[str] = None) -> "WorkerDevice":
        """This device as one worker's device, in ``group`` (default: its type's group)."""
        return WorkerDevice(self.type, self.index, group or self.type, self.uuid)


@dataclass(frozen=True)
class WorkerDevice:
    """The device one worker runs on, and the kaitian group it belongs to.

    Attributes:
        type: device type (``KAITIAN_DEVICE_TYPE``).
        index: the device's physical index on its host (``KAITIAN_DEVICE_INDEX``).
        group: kaitian group (``KAITIAN_GROUP``); defaults to ``type``.
        uuid: the vendor's device UUID (``KAITIAN_DEVICE_UUID``), if known.
    """

    type: str
    index: int
    group: str = ""
    uuid: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.group:
            object.__setattr__(self, "group", self.type)

    @property
    def key(self) -> str:
        """``"<type>:<index>"``, as :attr:`Device.key`."""
        return f"{self.type}:{self.index}"

    @property
    def explicit_group(self) -> bool:
        """Whether the group is not the type's own (simulated groups ``cpu0`` …)."""
        return self.group != self.type

    def to_json(self) -> list:
        """``[type, index, group]`` (the wire form in the rendezvous and the backend's rank records)."""
        return [self.type, self.index, self.group]

    @classmethod
    def from_json(cls, raw: Sequence) -> "WorkerDevice":
        return cls(str(raw[0]), int(raw[1]), str(raw[2]))


@dataclass(frozen=True)
class ContainerDevices:
    """What a container needs so that it sees exactly a set of host devices.

    Attributes:
        device_requests: docker SDK ``DeviceRequest`` keyword arguments (NVIDIA:
            GPUs by UUID where known, else by physical index).
        device_nodes: device nodes as ``host:container:rwm`` (Cambricon).
        env: the vendor's variables for the container's view: its visibility
            variable listing the container's devices in the container's order.
        index_map: physical index -> torch ordinal inside the container.
    """

    device_requests: Tuple[Mapping[str, object], ...] = ()
    device_nodes: Tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    index_map: Mapping[int, int] = field(default_factory=dict)

    @property
    def visible_indices(self) -> Tuple[int, ...]:
        """The devices' physical indices in the container's order (``KAITIAN_VISIBLE_INDICES``)."""
        return tuple(sorted(self.index_map, key=self.index_map.__getitem__))
