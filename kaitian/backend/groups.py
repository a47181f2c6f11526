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
    """What one rank tells the others at construction."""

    rank: int
    group: str
    device_type: str
    device_index: int
    host: str
    pid: int
    pid_ns: int
    bridge: str = "auto"
    intra: str = "auto"
    chunk_bytes: int = 1 << 20
    run_dir: str = ""

    @property
    def device(self) -> WorkerDevice:
        """The rank's device in the devices vocabulary (``device_type``/``device_index`` on the wire)."""
        return WorkerDevice(self.device_type, self.device_index, self.group)

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

    def group_rank(self, rank: int) -> int:
        """Rank ``rank``'s index inside its group."""
        return self.members[self.group_of[rank]].index(rank)


def local_rank_info(rank: int, s: Settings) -> RankInfo:
    """This rank's record: its device as :func:`kaitian.devices.rank.rank_device` says
    (the launcher's, else inferred), group from ``KAITIAN_GROUP``, else the device type."""
    from kaitian.backend.shm_gc import pid_namespace
    from kaitian.devices.rank import rank_device

    dev = rank_device()
    return RankInfo(
        rank=rank,
        group=dev.group,
        device_type=dev.type,
        device_index=dev.index,
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
    store.set(f"kaitian/info/{rank}", json.dumps(asdict(info)))
    keys = [f"kaitian/info/{r}" for r in range(size)]
    store.wait(keys, timeout)
    return [RankInfo(**json.loads(store.get(k))) for k in keys]


def build_layout(infos: List[RankInfo]) -> Layout:
    """Derives the layout; the same on every rank.

    Raises:
        LayoutError: one group mixes device types.
    """
    names: List[str] = []
    devices: Dict[str, str] = {}
    for info in infos:
        if info.group not in devices:
            names.append(info.group)
            devices[info.group] = info.device_type
        elif devices[info.group] != info.device_type:
            raise LayoutError(
                f"group {info.group!r} mixes device types {devices[info.group]!r} and "
                f"{info.device_type!r} (rank {info.rank}); give each vendor its own KAITIAN_GROUP"
            )
    index = {n: i for i, n in enumerate(names)}
    group_of = [index[i.group] for i in infos]
    members = [[i.rank for i in infos if i.group == n] for n in names]
    return Layout(
        group_names=names,
        group_device=[devices[n] for n in names],
        group_of=group_of,
        members=members,
        single_host=len({i.node for i in infos}) == 1,
    )
