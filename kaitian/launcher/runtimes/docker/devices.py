"""Which physical devices a container gets, and how its workers number them.

The launcher plans a worker on ``(device_type, index)`` where ``index`` is
the agent's view: torch's ordinal under the agent's own visibility variable
(with ``CUDA_VISIBLE_DEVICES=2,3`` on the host, index 0 is physical GPU 2).
A container must get exactly the planned physical devices (GPUs by UUID when
known, else by the driver's index) and its workers must see them numbered as
the container does: from 0, in PCI bus order.

``container_devices`` is the per-vendor part. It stands in for the vendor
table's container-devices hook (``kaitian.devices``) until that lands; the
rest of the docker runtime only sees ``PhysicalDevice`` and
``ContainerDevices``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple

from kaitian.devices.vendors import VENDORS
from kaitian.errors import DockerOptionError

__all__ = ["PhysicalDevice", "ContainerDevices", "physical_device", "container_devices", "container_visible"]


@dataclass(frozen=True)
class PhysicalDevice:
    """One planned device as the driver names it.

    Attributes:
        vendor: device type (``cuda``, ``mlu``).
        index: the planned index (the agent's view, as in ``WorkerLaunch``).
        physical_index: the driver's index (``nvidia-smi`` / ``cnmon``), if known.
        uuid: the device's UUID (``GPU-…``, ``MIG-…``), if known.
    """

    vendor: str
    index: int
    physical_index: Optional[int] = None
    uuid: Optional[str] = None

    @property
    def host_id(self) -> str:
        """How the host's visibility variable and the engine name it: UUID, else index."""
        return self.uuid or str(self.physical_index if self.physical_index is not None else self.index)


@dataclass(frozen=True)
class ContainerDevices:
    """What a container needs to see exactly its devices.

    Attributes:
        device_requests: docker ``DeviceRequest`` dicts (NVIDIA).
        device_nodes: ``host:container:rwm`` device nodes (Cambricon).
        env: variables every worker of the container gets.
        order: the devices in the container's numbering (container index = position).
    """

    device_requests: Tuple[Mapping[str, object], ...] = ()
    device_nodes: Tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    order: Tuple[PhysicalDevice, ...] = ()

    def container_index(self, index: int) -> Optional[int]:
        """The container's index of the device planned as ``index``."""
        for i, d in enumerate(self.order):
            if d.index == index:
                return i
        return None


def physical_device(
    vendor: str,
    index: int,
    env: Mapping[str, str],
    uuids: Optional[Mapping[int, str]] = None,
) -> PhysicalDevice:
    """Resolves a planned device to the driver's identity.

    Args:
        vendor: device type.
        index: the planned index (the agent's view).
        env: the agent's environment (its visibility variable renumbers devices).
        uuids: physical index -> UUID, where discovery knows them.

    Raises:
        DockerOptionError: the index is outside the agent's visibility variable.
    """
    visible_env = VENDORS[vendor].visible_env if vendor in VENDORS else None
    raw = env.get(visible_env, "") if visible_env else ""
    entries = [e.strip() for e in raw.split(",") if e.strip()] if raw.strip() else []
    entry = str(index)
    if entries:
        if index >= len(entries):
            raise DockerOptionError(
                f"{vendor}:{index} is not visible under {visible_env}={raw}; select a device it lists"
            )
        entry = entries[index]
    if entry.isdigit():
        physical = int(entry)
        return PhysicalDevice(vendor, index, physical, (uuids or {}).get(physical))
    by_uuid = {u: p for p, u in (uuids or {}).items()}
    return PhysicalDevice(vendor, index, by_uuid.get(entry), entry)


def _in_bus_order(devices: Iterable[PhysicalDevice]) -> Tuple[PhysicalDevice, ...]:
    """Unique devices in the order a container numbers them: the driver's index
    (PCI bus order); devices known only by UUID keep their planned order, last."""
    unique: Dict[str, PhysicalDevice] = {}
    for d in devices:
        unique.setdefault(d.host_id, d)
    known = sorted((d for d in unique.values() if d.physical_index is not None), key=lambda d: d.physical_index)
    return tuple(known) + tuple(d for d in unique.values() if d.physical_index is None)


def _mlu_nodes(indices: Sequence[int], present: Iterable[str]) -> Tuple[str, ...]:
    """Cambricon device nodes for the selected MLUs: control node, cards, IPC nodes."""
    present = set(present)
    wanted = ["/dev/cambricon_ctl"]
    for i in indices:
        wanted += [f"/dev/cambricon_dev{i}", f"/dev/cambricon_ipcm{i}", f"/dev/ipcm{i}"]
    missing = [p for p in ["/dev/cambricon_ctl"] + [f"/dev/cambricon_dev{i}" for i in indices] if p not in present]
    if missing:
        raise DockerOptionError(
            f"MLU device node(s) {', '.join(missing)} not found on this host; "
            "check the Cambricon driver (cnmon) or select other MLUs with USE_MLU"
        )
    return tuple(f"{p}:{p}:rwm" for p in wanted if p in present)


def container_devices(
    vendor: str, devices: Sequence[PhysicalDevice], present_nodes: Iterable[str] = ()
) -> ContainerDevices:
    """What a container of ``vendor`` needs to hold exactly ``devices``.

    NVIDIA: one device request naming the GPUs by UUID (the driver's index
    where no UUID is known); ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so the
    container numbers them in bus order, as ``nvidia-smi`` does. Cambricon:
    the control node and each card's nodes at their host paths (the driver
    numbers the cards a container holds from 0 in node order).

    Raises:
        DockerOptionError: an MLU's device node is missing, or an MLU is named
            only by a UUID (its node cannot be found).
    """
    order = _in_bus_order(devices)
    if vendor == "cuda" and order:
        request = {"driver": "nvidia", "device_ids": [d.host_id for d in order], "capabilities": [["gpu"]]}
        return ContainerDevices(device_requests=(request,), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, order=order)
    if vendor == "mlu" and order:
        unknown = [d.host_id for d in order if d.physical_index is None]
        if unknown:
            raise DockerOptionError(f"MLU {unknown[0]}: give MLU_VISIBLE_DEVICES as card indices, not UUIDs")
        nodes = _mlu_nodes([d.physical_index for d in order if d.physical_index is not None], present_nodes)
        return ContainerDevices(device_nodes=nodes, order=order)
    return ContainerDevices(order=order)


def container_visible(raw: Optional[str], devices: ContainerDevices) -> str:
    """A worker's visibility variable renumbered to the container's view.

    Args:
        raw: the value the agent gave the worker (host ids, e.g. ``2,3`` or
            one device under ``--virtual-local-rank``), or ``None``.
        devices: the container's devices.

    Returns:
        The container indices of the listed devices it holds (all of them
        when ``raw`` is ``None``), ascending, comma-separated: torch's
        ordinal inside is then the container index itself.
    """
    if raw is None:
        return ",".join(str(i) for i in range(len(devices.order)))
    position = {d.host_id: i for i, d in enumerate(devices.order)}
    position.update({str(d.physical_index): i for i, d in enumerate(devices.order) if d.physical_index is not None})
    listed = {position[item] for item in (x.strip() for x in raw.split(",")) if item in position}
    return ",".join(str(i) for i in sorted(listed))
