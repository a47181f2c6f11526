"""The ``kaitian`` rendezvous: torchelastic's c10d rendezvous plus a device-inventory exchange.

Nodes with different device mixes form one world because every node publishes
its inventory (one :class:`~kaitian.launcher.placement.Slot` per local worker)
in the rendezvous store, and every node reads all of them back before ranks
are assigned. ``--rdzv-backend kaitian`` does the exchange inside
``next_rendezvous``; with the other backends (``c10d``, ``static``,
``--standalone``) the agent runs the same exchange on the store the
rendezvous returned (:func:`exchange_inventory`).

The handler is registered with torchelastic under ``"kaitian"`` when this
module is imported, and through the ``torchrun.handlers`` entry point
(:func:`handler_creator_entry`), so plain ``torchrun --rdzv-backend kaitian``
works as well.
"""

from __future__ import annotations

import json
import logging
from typing import List, Optional, Sequence, Tuple

from kaitian import _torch as _te
from kaitian.launcher.placement import Slot

__all__ = [
    "BACKEND_NAME",
    "KaitianRendezvousHandler",
    "create_handler",
    "handler_creator_entry",
    "exchange_inventory",
    "register",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "kaitian"
_INVENTORY_PREFIX = "kaitian/inventory"


def exchange_inventory(
    store, group_rank: int, group_world_size: int, slots: Sequence[Slot]
) -> Tuple[int, List[List[Slot]]]:
    """Publishes this node's slots and returns every node's, indexed by group rank.

    Keys carry a per-node exchange counter, so a store that outlives a
    rendezvous round (the static rendezvous keeps one store for the whole run)
    never serves a previous round's inventory.

    Args:
        store: the rendezvous store (shared by all nodes of this round).
        group_rank: this node's rank.
        group_world_size: number of nodes.
        slots: this node's workers, in local-rank order.

    Returns:
        ``(epoch, inventories)``: the exchange's number (the same on every
        node; a key prefix for anything else exchanged in this round) and the
        inventories of all nodes, indexed by group rank.
    """
    epoch = store.add(f"{_INVENTORY_PREFIX}/epoch/{group_rank}", 1)
    prefix = f"{_INVENTORY_PREFIX}/{epoch}"
    store.set(f"{prefix}/{group_rank}", json.dumps([s.to_json() for s in slots]))
    raw = store.multi_get([f"{prefix}/{r}" for r in range(group_world_size)])
    return epoch, [[Slot.from_json(s) for s in json.loads(bytes(b).decode())] for b in raw]


class KaitianRendezvousHandler(_te.RendezvousHandler):
    """Wraps a torchelastic rendezvous: adds the inventory exchange and a scale-up fix.

    Set :attr:`local_slots` before :meth:`next_rendezvous`; afterwards
    :attr:`inventories` holds every node's slots for the round. As
    ``--rdzv-backend kaitian`` it wraps c10d's dynamic rendezvous; the launcher
    also wraps the other backends with it (keeping their name), so every
    backend gets the same behaviour.

    Args:
        inner: the rendezvous doing the actual join.
        name: what :meth:`get_backend` reports.
    """

    def __init__(self, inner: "_te.RendezvousHandler", name: str = BACKEND_NAME) -> None:
        self._inner = inner
        self._name = name
        self.local_slots: Optional[List[Slot]] = None
        self.inventories: Optional[List[List[Slot]]] = None
        self.epoch: Optional[int] = None

    def get_backend(self) -> str:
        return self._name

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self):
        info = self._inner.next_rendezvous()
        if info.rank == 0 and info.bootstrap_store_info is not None:
            # torch 2.13's dynamic rendezvous publishes the agent store's address
            # only in the round where node 0 created it; a node joining a later
            # round (scale-up) waits for it in that round's store until it times
            # out. Node 0 republishes it in every round.
            info.store.set(_te.RendezvousStoreInfo.MASTER_ADDR_KEY, info.bootstrap_store_info.master_addr)
            info.store.set(_te.RendezvousStoreInfo.MASTER_PORT_KEY, str(info.bootstrap_store_info.master_port))
        self.inventories = self.epoch = None
        if self.local_slots is not None:
            self.epoch, self.inventories = exchange_inventory(
                info.store, info.rank, info.world_size, self.local_slots
            )
            logger.info("kaitian rendezvous: inventories %s", self.inventories)
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
