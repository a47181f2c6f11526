"""What a device is, in the one vocabulary used from host planning to the backend.

``type`` is the device type (``cuda``, ``mlu``, ``cpu``: ``KAITIAN_DEVICE_TYPE``)
and ``index`` is the device's *physical* index on its host: the number
``nvidia-smi`` / ``cnmon`` / ``kaitian devices`` show, which ``USE_<VENDOR>``
and ``--devices`` select and which ``KAITIAN_DEVICE_INDEX`` carries (CPU: the
slot index). The index torch uses inside a worker (its ordinal) depends on
what the worker can see and is worked out there (:mod:`kaitian.devices.visible`).

- :class:`Device`: one entry of a host's inventory (with name, memory, cores).
- :class:`WorkerDevice`: the device one worker runs on and its kaitian group;
  the worker plan, the rendezvous inventory, the runtime's launch record and
  the backend's rank record all hold this one dataclass.
- :class:`ContainerDevices`: what a container needs to see a set of devices.

Every other devices module builds on this one; it needs nothing of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple


__all__ = ["Device", "WorkerDevice", "ContainerDevices", "DEVICE_ENV"]

# The worker's environment variables that name its device.
DEVICE_ENV = {
    "type": "KAITIAN_DEVICE_TYPE",
    "index": "KAITIAN_DEVICE_INDEX",
    "group": "KAITIAN_GROUP",
    "uuid": "KAITIAN_DEVICE_UUID",
}


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
        return WorkerDevice(self.type, self.index, group or self.type, self.uuid, self.bus_id)


@dataclass(frozen=True)
class WorkerDevice:
    """The device one worker runs on, and the kaitian group it belongs to.

    Attributes:
        type: device type (``KAITIAN_DEVICE_TYPE``).
        index: the device's physical index on its host (``KAITIAN_DEVICE_INDEX``).
        group: kaitian group (``KAITIAN_GROUP``); defaults to ``type``.
        uuid: the vendor's device UUID (``KAITIAN_DEVICE_UUID``), if known.
        bus_id: PCI bus id, if known (not passed to the worker).
    """

    type: str
    index: int
    group: str = ""
    uuid: Optional[str] = None
    bus_id: Optional[str] = field(default=None, compare=False)

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

    def to_env(self) -> Dict[str, str]:
        """The worker's ``KAITIAN_DEVICE_*`` / ``KAITIAN_GROUP`` variables.

        ``KAITIAN_GROUP`` only for an explicit group, as the backend defaults
        the group to the device type.
        """
        env = {DEVICE_ENV["type"]: self.type, DEVICE_ENV["index"]: str(self.index)}
        if self.explicit_group:
            env[DEVICE_ENV["group"]] = self.group
        if self.uuid:
            env[DEVICE_ENV["uuid"]] = self.uuid
        return env

    def to_json(self) -> list:
        """``[type, index, group]`` (the rendezvous inventory's wire form)."""
        return [self.type, self.index, self.group]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["WorkerDevice"]:
        """The device a launcher gave this worker, or ``None`` without ``KAITIAN_DEVICE_TYPE``.

        Raises:
            SettingError: ``KAITIAN_DEVICE_INDEX`` is not an integer.
        """
        from kaitian.settings import Settings

        s = Settings.from_env(env)
        if not s.device_type:
            return None
        index = s.device_index if s.device_index is not None else 0
        return cls(s.device_type, index, s.group or s.device_type, s.device_uuid)


@dataclass(frozen=True)
class ContainerDevices:
    """What a container needs so that it sees exactly a set of host devices.

    Attributes:
        device_requests: docker SDK ``DeviceRequest`` keyword arguments (NVIDIA:
            GPUs by UUID where known, else by physical index).
        device_nodes: device nodes as ``host:container:rwm`` (Cambricon).
        env: variables every worker in the container gets: the vendor's
            visibility variable listing the container's devices in the
            container's order, and ``KAITIAN_VISIBLE_INDICES`` with their
            physical indices in the same order (so a worker turns
            ``KAITIAN_DEVICE_INDEX`` into its torch ordinal).
        index_map: physical index -> torch ordinal inside the container.
    """

    device_requests: Tuple[Mapping[str, object], ...] = ()
    device_nodes: Tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    index_map: Mapping[int, int] = field(default_factory=dict)
