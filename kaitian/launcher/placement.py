"""How global ranks are laid out over nodes with different device mixes.

Ranks are grouped by vendor (in the vendor table's order: accelerators first,
CPU last), then by kaitian group name, then by node (group rank) and local
rank. A job whose nodes all run one device type gets exactly torchrun's
layout (``rank = node offset + local rank``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from kaitian.devices.device import WorkerDevice
from kaitian.devices.vendors import vendor_names

__all__ = ["NodeInventory", "Placement", "lay_out"]


@dataclass(frozen=True)
class NodeInventory:
    """What one node tells node 0 in a round.

    Attributes:
        role: its workers' torchelastic role.
        devices: its workers' devices, in local-rank order.
        host: its host name (for messages).
        version: its kaitian version.
        protocol: its bridge protocol version.
    """

    role: str
    devices: Tuple[WorkerDevice, ...]
    host: str
    version: str
    protocol: int

    def to_json(self) -> str:
        # One [type, index, group, role] per worker: the form every kaitian
        # release writes, so node 0 reads any node's versions and can say they differ.
        return json.dumps({
            "slots": [[*d.to_json(), self.role] for d in self.devices],
            "host": self.host,
            "version": self.version,
            "protocol": self.protocol,
        })

    @classmethod
    def from_json(cls, raw: str) -> "NodeInventory":
        d = json.loads(raw)
        slots = d["slots"]
        role = str(slots[0][3]) if slots else ""
        return cls(role, tuple(WorkerDevice.from_json(s[:3]) for s in slots), d["host"], d["version"],
                   int(d["protocol"]))


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


def lay_out(inventories: Sequence[NodeInventory]) -> Dict[Tuple[int, int], Placement]:
    """Assigns every worker of every node its global and role ranks.

    Args:
        inventories: per node, indexed by group rank.

    Returns:
        ``(group_rank, local_rank) -> Placement``.
    """
    workers: List[Tuple[Tuple, int, int, str]] = []
    for group_rank, inv in enumerate(inventories):
        for local_rank, dev in enumerate(inv.devices):
            key = (_order(dev.type), dev.type, dev.group, group_rank, local_rank)
            workers.append((key, group_rank, local_rank, inv.role))
    workers.sort(key=lambda w: w[0])
    world = len(workers)
    role_sizes: Dict[str, int] = {}
    for *_, role in workers:
        role_sizes[role] = role_sizes.get(role, 0) + 1
    role_next: Dict[str, int] = {}
    placements: Dict[Tuple[int, int], Placement] = {}
    for rank, (_, group_rank, local_rank, role) in enumerate(workers):
        role_rank = role_next.get(role, 0)
        role_next[role] = role_rank + 1
        placements[(group_rank, local_rank)] = Placement(rank, world, role_rank, role_sizes[role])
    return placements
