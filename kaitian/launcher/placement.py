"""How global ranks are laid out over nodes with different device mixes.

Ranks are grouped by vendor (in the vendor table's order: accelerators first,
CPU last), then by kaitian group name, then by node (group rank) and local
rank. A job whose nodes all run one device type gets exactly torchrun's
layout (``rank = node offset + local rank``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from kaitian.devices.device import WorkerDevice
from kaitian.devices.vendors import vendor_names

__all__ = ["Slot", "Placement", "lay_out"]


@dataclass(frozen=True)
class Slot:
    """What one local worker of a node runs on (one entry of a node's inventory).

    Attributes:
        device: its device and kaitian group.
        role: torchelastic role of the worker.
    """

    device: WorkerDevice
    role: str

    def to_json(self) -> list:
        """``[type, index, group, role]``, the inventory's wire form."""
        return [*self.device.to_json(), self.role]

    @classmethod
    def from_json(cls, raw: Sequence) -> "Slot":
        return cls(WorkerDevice(str(raw[0]), int(raw[1]), str(raw[2])), str(raw[3]))


@dataclass(frozen=True)
class Placement:
    """A worker's ranks in the world."""

    global_rank: int
    world_size: int
    role_rank: int
    role_world_size: int


def _order(vendor: str) -> int:
    names = vendor_names()
    return names.index(vendor) if vendor in names else len(names)


def lay_out(inventories: Sequence[Sequence[Slot]]) -> Dict[Tuple[int, int], Placement]:
    """Assigns every worker of every node its global and role ranks.

    Args:
        inventories: per node (indexed by group rank), its workers' slots in
            local-rank order.

    Returns:
        ``(group_rank, local_rank) -> Placement``.
    """
    workers: List[Tuple[Tuple, int, int, Slot]] = []
    for group_rank, slots in enumerate(inventories):
        for local_rank, slot in enumerate(slots):
            dev = slot.device
            key = (_order(dev.type), dev.type, dev.group, group_rank, local_rank)
            workers.append((key, group_rank, local_rank, slot))
    workers.sort(key=lambda w: w[0])
    world = len(workers)
    role_sizes: Dict[str, int] = {}
    for *_, slot in workers:
        role_sizes[slot.role] = role_sizes.get(slot.role, 0) + 1
    role_next: Dict[str, int] = {}
    placements: Dict[Tuple[int, int], Placement] = {}
    for rank, (_, group_rank, local_rank, slot) in enumerate(workers):
        role_rank = role_next.get(slot.role, 0)
        role_next[slot.role] = role_rank + 1
        placements[(group_rank, local_rank)] = Placement(rank, world, role_rank, role_sizes[slot.role])
    return placements
