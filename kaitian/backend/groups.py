"""Who is in which vendor group: this rank's identity and the world's layout.

Every rank publishes a small record (group, device type, host, pid, settings
that must agree) through the process group's store; every rank then derives the
same layout from the same records.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Dict, List

from kaitian.devices.device import WorkerDevice
from kaitian.settings import Settings
from kaitian.errors import LayoutError

__all__ = ["RankInfo", "Layout", "LayoutError", "local_rank_info", "exchange_infos", "build_layout"]


@dataclass(frozen=True)
class RankInfo:
    """What one rank tells the others at construction.

    Attributes:
        rank: its rank in the group.
        device: its device and kaitian group.
        host, pid, pid_ns: where it runs (who can reach its shared memory).
        bridge, intra, chunk_bytes: its settings that must agree (rank 0's are used).
        run_dir: its run directory (``KAITIAN_RUN_DIR``), resolved.
    """

    rank: int
    device: WorkerDevice
    host: str
    pid: int
    pid_ns: int
    bridge: str = "auto"
    intra: str = "auto"
    chunk_bytes: int = 1 << 20
    run_dir: str = ""

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "device": self.device.to_json()})

    @classmethod
    def from_json(cls, raw: str) -> "RankInfo":
        d = json.loads(raw)
        return cls(**{**d, "device": WorkerDevice.from_json(d["device"])})

    @property
    def node(self) -> tuple:
        """Which ranks can meet through shared memory: same host and same run
        directory (two kaitianrun agents on one host are two nodes)."""
        return (self.host, self.run_dir)


@dataclass
class Layout:
    """The world as every rank sees it.

    Attributes:
        group_names: groups in a fixed order (by their lowest rank).
        group_device: device type of each group.
        group_of: per rank, the index of its group.
        members: per group, its ranks in ascending order (= group-rank order).
        single_host: whether every rank runs on the same node (host and run
            directory), so that the shared-memory bridge can connect them.
    """

    group_names: List[str]
    group_device: List[str]
    group_of: List[int]
    members: List[List[int]] = field(default_factory=list)
    single_host: bool = True


def local_rank_info(rank: int, s: Settings) -> RankInfo:
    """This rank's record: its device as :func:`kaitian.devices.rank.rank_device` says
    (the launcher's, else inferred), group from ``KAITIAN_GROUP``, else the device type."""
    from kaitian.backend.shm_gc import pid_namespace
    from kaitian.devices.rank import rank_device

    return RankInfo(
        rank=rank,
        device=rank_device(),
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_ns=pid_namespace(),
        bridge=s.bridge,
        intra=s.intra,
        chunk_bytes=s.chunk_bytes,
        run_dir=os.path.realpath(s.run_dir) if s.run_dir else "",
    )


def exchange_infos(store, rank: int, size: int, info: RankInfo, timeout: timedelta) -> List[RankInfo]:
    """Publishes ``info`` and returns every rank's record, in rank order."""
    store.set(f"kaitian/info/{rank}", info.to_json())
    keys = [f"kaitian/info/{r}" for r in range(size)]
    store.wait(keys, timeout)
    return [RankInfo.from_json(store.get(k)) for k in keys]


def build_layout(infos: List[RankInfo]) -> Layout:
    """Derives the layout; the same on every rank.

    Raises:
        LayoutError: one group mixes device types.
    """
    names: List[str] = []
    devices: Dict[str, str] = {}
    for info in infos:
        group, kind = info.device.group, info.device.type
        if group not in devices:
            names.append(group)
            devices[group] = kind
        elif devices[group] != kind:
            raise LayoutError(
                f"group {group!r} mixes device types {devices[group]!r} and "
                f"{kind!r} (rank {info.rank}); give each vendor its own KAITIAN_GROUP"
            )
    index = {n: i for i, n in enumerate(names)}
    group_of = [index[i.device.group] for i in infos]
    members = [[i.rank for i in infos if i.device.group == n] for n in names]
    return Layout(
        group_names=names,
        group_device=[devices[n] for n in names],
        group_of=group_of,
        members=members,
        single_host=len({i.node for i in infos}) == 1,
    )
