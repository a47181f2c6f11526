"""Two-rank shared-memory kaitian backends built directly through ``kaitian._C``
(no process group), for tests that drive the C++ backend: ``shm_backend(rank,
meet, token)`` builds one rank's (they meet through a FileStore at ``meet``);
``build_pair(meet, token, spin_us=...)`` builds both ranks in one process, one
thread each, and returns ``{rank: backend or the exception its build raised}``."""

from __future__ import annotations

import threading
from typing import Dict


def shm_backend(rank: int, meet, token: str, *, timeout_ms: int = 3000, chunk_bytes: int = 1 << 16,
                spin_us: int = 50, pids=(-1, -1)):
    """Rank ``rank`` of a two-rank backend over two CPU groups (``cpu0``, ``cpu1``);
    ``meet``: a FileStore path, or the store itself."""
    import torch.distributed as dist

    from kaitian import _C
    from kaitian.backend import shm_gc

    store = dist.FileStore(meet, 2) if isinstance(meet, str) else meet
    return _C.create_backend(
        store=dist.HashStore(), rank=rank, size=2, timeout_ms=timeout_ms,
        layout=_C.Layout(group_of=[0, 1], group_names=["cpu0", "cpu1"], group_device=["cpu", "cpu"]),
        bridge=_C.ShmBridgeOptions(store=store, name=shm_gc.segment_name(token, rank), chunk_bytes=chunk_bytes,
                                   pids=list(pids), spin_us=spin_us),
    )


def build_pair(meet: str, token: str, **options) -> Dict[int, object]:
    built: Dict[int, object] = {}

    def build(rank: int) -> None:
        try:
            built[rank] = shm_backend(rank, meet, token, **options)
        except Exception as e:  # noqa: BLE001 (the caller checks it)
            built[rank] = e

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return built
