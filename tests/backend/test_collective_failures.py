"""A dead peer or a late one turns into an error within the timeout, not a hang.

Real processes are killed (SIGKILL) in the middle of a job on two simulated
groups; the survivors' next collectives must fail within the process group's
timeout (10 s here) with an error, and shared memory must not pile up.
"""

from __future__ import annotations

import json
import os
import sys

import pytest


from workers.failure import PG_TIMEOUT
from support import worker
from support.ranks import Layout, cleanup, run_ranks, shm_segments, tail

_SCRIPT = worker("failure")


def _records(run) -> dict:
    recs = {}
    for rank, path in enumerate(run.outs):
        if os.path.exists(path):
            with open(path) as fh:
                recs[rank] = json.loads(fh.readline())
    return recs


def _logs(run) -> str:
    return "\n".join(f"--- rank {r} ---\n{tail(p, 15)}" for r, p in enumerate(run.logs))


@pytest.mark.parametrize("victim,where", [(2, "other group (bridge)"), (1, "same group as rank 0 (intra)")])
def test_dead_peer_fails_survivors_within_timeout(victim: int, where: str) -> None:
    layout = Layout("2+1")
    run = run_ranks(layout, [_SCRIPT, "--scenario", f"kill-{victim}"], timeout=PG_TIMEOUT * 6)
    try:
        recs = _records(run)
        survivors = [r for r in range(layout.world_size) if r != victim]
        assert not run.timed_out, f"survivors hung after rank {victim} ({where}) died:\n{_logs(run)}"
        for r in survivors:
            rec = recs.get(r)
            assert rec is not None, f"rank {r} wrote nothing (exit {run.returncodes[r]}):\n{_logs(run)}"
            assert rec["first_ok"], rec
            assert rec["raised"], f"rank {r}: {rec['msg']}"
            assert rec["seconds"] < PG_TIMEOUT * 3, f"rank {r} took {rec['seconds']:.1f}s to fail: {rec['msg']}"
        # A second job in the same run directory collects what the dead rank left.
        rerun = run_ranks(Layout("1+1"), [_SCRIPT, "--scenario", "none"], timeout=60, workdir=run.workdir)
        assert rerun.returncodes == [0, 0], _logs(rerun)
        # (the two jobs' own: the serial tests run beside the parallel pass's jobs)
        leftover = sorted(shm_segments(run.pids + rerun.pids))
        assert not leftover, f"shared memory left after a killed rank and a later job: {leftover}"
    finally:
        cleanup(run)


def test_wait_timeout_is_honoured() -> None:
    layout = Layout("1+1")
    run = run_ranks(layout, [_SCRIPT, "--scenario", "wait-timeout"], timeout=60)
    try:
        rec = _records(run).get(0)
        assert rec is not None, _logs(run)
        assert rec["raised"], rec["msg"]
        assert rec["seconds"] < 5, f"wait(timeout=1s) took {rec['seconds']:.1f}s"
    finally:
        cleanup(run)
