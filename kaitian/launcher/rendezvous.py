"""The ``kaitian`` rendezvous: torchelastic's c10d rendezvous, then one placement per round.

Nodes with different device mixes form one world in two steps after
torchelastic's join:

1. every node publishes its :class:`NodeInventory` (its workers' devices, its
   kaitian version and bridge protocol version) in the round's store;
2. node 0 reads them all (one request), checks the versions, lays the ranks
   out by vendor (:func:`~kaitian.launcher.placement.lay_out`), decides where the
   workers' store is, and publishes each node its share; every other node reads
   one key (:func:`agree_on_placement`).

So a round costs O(nodes) store requests, and every node starts its workers
from the same decision. ``--rdzv-backend kaitian`` is c10d's dynamic
rendezvous under this name; kaitianrun wraps the other backends (``c10d``,
``static``, ``--standalone``) in the same handler, so all of them behave alike.

The handler is registered with torchelastic under ``"kaitian"`` when this
module is imported, and through the ``torchrun.handlers`` entry point
(:func:`handler_creator_entry`), so plain ``torchrun --rdzv-backend kaitian``
works as well.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from kaitian import _torch as _te
from kaitian.devices.device import WorkerDevice
from kaitian.errors import KaitianError, RendezvousError, VersionMismatchError
from kaitian.launcher.placement import NodeInventory, Placement, lay_out
from kaitian import version as _version

__all__ = [
    "BACKEND_NAME",
    "NodePlacement",
    "KaitianRendezvousHandler",
    "agree_on_placement",
    "check_versions",
    "create_handler",
    "handler_creator_entry",
    "local_inventory",
    "register",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "kaitian"
_PREFIX = "kaitian/round"

def local_inventory(role: str, devices: Sequence[WorkerDevice]) -> NodeInventory:
    """This node's inventory: its workers' role and devices, plus the versions it runs."""
    return NodeInventory(role, tuple(devices), socket.gethostname(), _version.__version__, _version.bridge_protocol())


def check_versions(inventories: Sequence[NodeInventory]) -> None:
    """Raises unless every node runs node 0's kaitian and bridge protocol versions.

    Raises:
        VersionMismatchError: one line naming node 0's versions and the first node that differs.
    """
    first = inventories[0]
    for rank, inv in enumerate(inventories):
        if (inv.version, inv.protocol) != (first.version, first.protocol):
            raise VersionMismatchError(
                f"nodes run different kaitian versions: node 0 ({first.host}) has kaitian {first.version} "
                f"(bridge protocol {first.protocol}), node {rank} ({inv.host}) has kaitian {inv.version} "
                f"(bridge protocol {inv.protocol}); install the same kaitian on every node"
            )


@dataclass(frozen=True)
class NodePlacement:
    """This node's share of a round's placement, as node 0 decided it.

    Attributes:
        epoch: the round's exchange number (the same on every node).
        placements: per local rank, its ranks in the world.
        worker_store: ``(addr, port)`` of the store the workers use, or
            ``None`` to keep what the rendezvous returned.
    """

    epoch: int
    placements: Tuple[Placement, ...]
    worker_store: Optional[Tuple[str, int]]


def agree_on_placement(
    store,
    group_rank: int,
    group_world_size: int,
    inventory: NodeInventory,
    serve_worker_store: Optional[Callable[[], Optional[Tuple[str, int]]]] = None,
) -> NodePlacement:
    """Publishes this node's inventory and returns this node's placement, decided once by node 0.

    Keys carry a per-node exchange counter, so a store that outlives a round
    (the static rendezvous keeps one store for the whole run) never serves a
    previous round's inventory or placement.

    Args:
        store: the round's rendezvous store.
        group_rank: this node's rank.
        group_world_size: number of nodes.
        inventory: this node's inventory.
        serve_worker_store: called on node 0 only, after the checks: starts the
            workers' store and returns its ``(addr, port)`` (or ``None``).

    Returns:
        This node's placement.

    Raises:
        VersionMismatchError: the nodes' versions differ (raised on every node, before any worker starts).
        RendezvousError: node 0 could not place the workers.
    """
    epoch = store.add(f"{_PREFIX}/epoch/{group_rank}", 1)
    prefix = f"{_PREFIX}/{epoch}"
    store.set(f"{prefix}/inventory/{group_rank}", inventory.to_json())
    share_keys = [f"{prefix}/placement/{r}" for r in range(group_world_size)]
    if group_rank == 0:
        raw = store.multi_get([f"{prefix}/inventory/{r}" for r in range(group_world_size)])
        inventories = [NodeInventory.from_json(bytes(b).decode()) for b in raw]
        logger.info("kaitian rendezvous: inventories %s", inventories)
        failure: Optional[KaitianError] = None
        try:
            check_versions(inventories)
            placements = lay_out(inventories)
            worker_store = serve_worker_store() if serve_worker_store else None
            shares = [
                json.dumps({
                    "placements": [list(_astuple(placements[(r, lr)])) for lr in range(len(inv.devices))],
                    "store": list(worker_store) if worker_store else None,
                })
                for r, inv in enumerate(inventories)
            ]
        except KaitianError as e:
            failure = e
            shares = [json.dumps({"error": str(e), "kind": type(e).__name__})] * group_world_size
        store.multi_set(share_keys, shares)
        if failure is not None:
            raise failure
        mine = json.loads(shares[0])
    else:
        mine = json.loads(bytes(store.get(share_keys[group_rank])).decode())
    if "error" in mine:
        kind = VersionMismatchError if mine.get("kind") == VersionMismatchError.__name__ else RendezvousError
        raise kind(mine["error"])
    ws = mine["store"]
    return NodePlacement(
        epoch=epoch,
        placements=tuple(Placement(*p) for p in mine["placements"]),
        worker_store=(str(ws[0]), int(ws[1])) if ws else None,
    )


def _astuple(p: Placement) -> tuple:
    return (p.global_rank, p.world_size, p.role_rank, p.role_world_size)


def _node_vendor() -> str:
    """The vendor plain torchrun's workers on this node use: its first selected device's."""
    from kaitian.devices.inventory import discover, select

    return select(discover())[0].type


class KaitianRendezvousHandler(_te.RendezvousHandler):
    """Wraps a torchelastic rendezvous: fixes node 0's store address and orders nodes by vendor.

    As ``--rdzv-backend kaitian`` it wraps c10d's dynamic rendezvous; the
    launcher also wraps the other backends with it (keeping their name), so
    every backend gets the same behaviour. After :meth:`next_rendezvous`,
    :attr:`last_info` is the round's ``RendezvousInfo``.

    Under plain ``torchrun --rdzv-backend kaitian`` (``order_nodes``), the
    round's node ranks are decided like kaitianrun's placement, from one device
    per node naming its vendor: nodes are ordered by vendor, so torchrun's
    ranks (node offset + local rank) come out grouped by vendor whenever each
    node runs one vendor, and the nodes' versions are checked. kaitianrun's
    agent places every worker itself and turns this off.

    Args:
        inner: the rendezvous doing the actual join.
        name: what :meth:`get_backend` reports.
        order_nodes: order node ranks by vendor (plain torchrun).
        node_vendor: this node's vendor (default: its first selected device's).
    """

    def __init__(
        self,
        inner: "_te.RendezvousHandler",
        name: str = BACKEND_NAME,
        order_nodes: bool = True,
        node_vendor: Callable[[], str] = _node_vendor,
    ) -> None:
        self._inner = inner
        self._name = name
        self.order_nodes = order_nodes
        self._node_vendor = node_vendor
        self._vendor: Optional[str] = None
        self.last_info: Optional["_te.RendezvousInfo"] = None

    def get_backend(self) -> str:
        return self._name

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self):
        info = self._inner.next_rendezvous()
        store, bootstrap = info.store, info.bootstrap_store_info
        keys = _te.RendezvousStoreInfo
        if bootstrap is not None:
            if info.rank == 0:
                # torch 2.13's dynamic rendezvous publishes the agent store's
                # address only in the round where node 0 created it; a node
                # joining a later round (scale-up) would wait for it until it
                # times out. Node 0 republishes it in every round.
                store.set(keys.MASTER_ADDR_KEY, bootstrap.master_addr)
                store.set(keys.MASTER_PORT_KEY, str(bootstrap.master_port))
            else:
                # The other nodes cache the first round's address; after the
                # node that held the store is lost it names a dead node.
                bootstrap = keys(
                    bytes(store.get(keys.MASTER_ADDR_KEY)).decode(),
                    int(bytes(store.get(keys.MASTER_PORT_KEY)).decode()),
                )
        rank = info.rank
        if self.order_nodes:
            if self._vendor is None:
                self._vendor = self._node_vendor()  # a node's devices do not change between rounds
            vendor = self._vendor
            mine = local_inventory("node", [WorkerDevice(vendor, 0)])
            rank = agree_on_placement(store, info.rank, info.world_size, mine).placements[0].global_rank
        info = _te.RendezvousInfo(store, rank, info.world_size, bootstrap)
        self.last_info = info
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def create_handler(params: "_te.RendezvousParameters") -> KaitianRendezvousHandler:
    """The torchelastic handler creator for ``--rdzv-backend kaitian`` (c10d store underneath).

    Accepts every ``--rdzv-conf`` key the c10d backend accepts.
    """
    backend, store = _te.create_c10d_backend(params)
    return KaitianRendezvousHandler(_te.create_dynamic_handler(store, backend, params))


def handler_creator_entry():
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments
    and registers the creator it returns under the entry point's name."""
    return create_handler


def register() -> None:
    """Registers ``kaitian`` with torchelastic's rendezvous registry (idempotent)."""
    try:
        _te.rendezvous_handler_registry.register(BACKEND_NAME, create_handler)
    except ValueError:
        # Already registered with another creator (a second copy of kaitian on
        # the path); keep the first one, as torch does for its own plug-ins.
        logger.warning("rendezvous backend %r is already registered; keeping it", BACKEND_NAME)


register()
