"""abort() aborts (issue 9, "abort() is shutdown()").

A rank blocked in a collective whose peer never comes (group timeout 60 s) has
its group aborted, or destroyed, from another thread: the call returns and the
blocked collective raises within a few seconds, later ops on the group raise,
and the process exits promptly (the missing peer stays alive meanwhile and
watches the others exit). Covered: a rank stuck in the vendor (gloo)
step inside its group, ranks stuck in the shared-memory and TCP bridges.
"""

from __future__ import annotations

import json

import pytest

from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail

WORKER = worker("abort")
BOUND_S = 4.0  # vs the 60 s group timeout

LAYOUTS = [
    Layout("2+1", env=(("KAITIAN_INTRA", "gloo"),)),  # rank 0 waits in gloo, rank 2 in the bridge
    Layout("2+1"),  # shared-memory bridge
    Layout("1+1", env=(("KAITIAN_BRIDGE", "tcp"),)),  # TCP bridge
]


@pytest.mark.parametrize("how", ["abort", "destroy"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[l.id for l in LAYOUTS])
def test_stop_returns_while_a_collective_is_stuck(layout: Layout, how: str) -> None:
    run = run_ranks(layout, [WORKER, "--how", how, "--missing", "1"], timeout=40)
    try:
        logs = "\n".join(f"--- rank {r} ---\n{tail(p)}" for r, p in enumerate(run.logs))
        assert not run.timed_out and run.returncodes == [0] * layout.world_size, logs
        with open(run.outs[1]) as fh:
            exits = json.loads(fh.readline())["exit_after_stop_s"]
        assert len(exits) == layout.world_size - 1, f"ranks did not exit: {exits}\n{logs}"
        assert max(exits.values()) < BOUND_S + 2, f"exit after the stop call took {exits}\n{logs}"
        for rank in range(layout.world_size):
            if rank == 1:
                continue
            with open(run.outs[rank]) as fh:
                rec = json.loads(fh.readline())
            assert rec["error"] is not None, f"rank {rank}: the stuck all_reduce returned\n{logs}"
            assert "kaitian" in rec["error"], rec
            assert not rec["stopper_alive"] and rec["call_s"] < BOUND_S, rec
            assert rec["raised_after_s"] < BOUND_S, rec
            assert rec["later"] is not None, f"rank {rank}: an op after {how} did not raise"
    finally:
        cleanup(run)
