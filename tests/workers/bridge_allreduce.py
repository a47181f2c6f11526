"""A rank that builds the default kaitian group and all-reduces rank-dependent values.

torchrun-style worker (RANK/WORLD_SIZE/MASTER_* from the environment, results as
JSON lines in ``KT_OUT``). Hooks for the bridge-security tests:

- ``KT_RANK_ENV``: JSON ``{rank: {VAR: value}}`` applied to this rank's
  environment before ``init_process_group`` (per-rank keys and port ranges);
- ``KT_BRIDGE_DELAY``: JSON ``{rank: seconds}``; that rank waits right before its
  bridge is built, so a stranger reaches rank 0's port first;
- ``KT_TIMEOUT``: the group timeout in seconds (default 30).

Lines written: ``{"event": "init", "seconds": s}`` then ``{"event": "allreduce",
"value": [...], "conns": [[lport, rport], ...], "master_port": p}``, or
``{"event": "error", "type": ..., "message": ...}`` when init fails.
"""

import argparse
import json
import os
import time
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

argparse.ArgumentParser().parse_known_args()  # run_ranks' legacy flags are ignored
rank = int(os.environ["RANK"])
os.environ.update(json.loads(os.environ.get("KT_RANK_ENV", "{}")).get(str(rank), {}))
import kaitian  # noqa: E402,F401  (after the per-rank environment: it reads KAITIAN_*)
from kaitian import _C  # noqa: E402

delay = float(json.loads(os.environ.get("KT_BRIDGE_DELAY", "{}")).get(str(rank), 0))
if delay:
    build = _C.create_backend

    def late_build(**kwargs):
        time.sleep(delay)
        return build(**kwargs)

    _C.create_backend = late_build


def emit(**record):
    with open(os.environ["KT_OUT"], "a") as f:
        f.write(json.dumps(record) + "\n")


start = time.monotonic()
try:
    dist.init_process_group("kaitian", timeout=timedelta(seconds=float(os.environ.get("KT_TIMEOUT", "30"))))
except Exception as exc:  # noqa: BLE001 (the test checks the exact message)
    emit(event="error", type=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start)
    # Rank 0 serves the store here (under torchrun the agent does): stay a moment, so
    # the others meet their own error rather than the store's disappearance.
    time.sleep(float(os.environ.get("KT_LINGER", "3")))
    raise SystemExit(3)
emit(event="init", seconds=time.monotonic() - start)
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
conns = [[c.laddr.port, c.raddr.port] for c in psutil.Process().net_connections("tcp")
         if c.status == psutil.CONN_ESTABLISHED and c.raddr]
emit(event="allreduce", value=t.tolist(), conns=conns, master_port=int(os.environ["MASTER_PORT"]))
dist.barrier()
dist.destroy_process_group()
