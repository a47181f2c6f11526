"""DDP over backend kaitian trains to the same parameters as DDP over gloo.

Two simulated vendor groups; the same model, data and optimizer on both
backends within the same processes, with and without comm hooks.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest


from workers.ddp_parity import VARIANTS
from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail

LAYOUTS = [Layout("1+1"), Layout("2+1"), Layout("2+1", env=(("KAITIAN_INTRA", "gloo"),))]
_SCRIPT = worker("ddp_parity")


@functools.lru_cache(maxsize=None)
def _result(layout: Layout, backend: str = "kaitian") -> dict:
    run = run_ranks(layout, [_SCRIPT, "--backend", backend], timeout=180)
    recs: dict = {}
    for rank, path in enumerate(run.outs):
        if os.path.exists(path):
            with open(path) as fh:
                for line in fh:
                    rec = json.loads(line)
                    recs.setdefault(rec["case"], [None] * layout.world_size)[rank] = rec
    info = {"returncodes": run.returncodes, "timed_out": run.timed_out, "logs": [tail(p) for p in run.logs]}
    cleanup(run)
    return {"recs": recs, "info": info}


@pytest.mark.parametrize("layout", LAYOUTS, ids=[l.id for l in LAYOUTS])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ddp_matches_gloo(layout: Layout, variant: str) -> None:
    res = _result(layout)
    recs = res["recs"].get(variant)
    if recs is None or any(r is None for r in recs):
        info = res["info"]
        logs = "\n".join(f"--- rank {i} ---\n{log}" for i, log in enumerate(info["logs"]))
        pytest.fail(f"[{layout.id}] DDP {variant}: no result; return codes {info['returncodes']}, "
                    f"timed out {info['timed_out']}\n{logs}")
    bad = [f"rank {i}: {r}" for i, r in enumerate(recs) if not r["ok"]]
    assert not bad, f"[{layout.id}] DDP {variant} differs from gloo:\n" + "\n".join(bad)


def test_ddp_ranks_exit_cleanly() -> None:
    for layout in LAYOUTS:
        info = _result(layout)["info"]
        assert info["returncodes"] == [0] * layout.world_size, (layout.id, info)
