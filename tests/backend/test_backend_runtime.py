"""Backend kaitian in real multi-process runs: layout, subgroups, p2p, TCP
bridge, dead peers, Work.wait(timeout) and the group timeout, shm lifecycle.

Ranks are processes (forks of support/zygote.py) with torchrun's variables
and ``KAITIAN_GROUP`` to split them into simulated vendors. The collective op x
dtype matrix lives in test_collectives.py; these tests cover what only the
backend knows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from support import REPO, worker
from support.ranks import free_port, kill_ranks, shm_segments
from support.zygote import start_rank

WORKER = worker("backend_runtime")


def launch(groups, argv, env=None, timeout=90.0, run_dir=True):
    """Runs one worker per entry of ``groups``; returns (results by rank, logs, leftovers)."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="kt-backend-test-")
    procs, log_paths = [], []
    for rank, group in enumerate(groups):
        e = {k: v for k, v in os.environ.items() if not k.startswith("KAITIAN_")}
        e.update(RANK=str(rank), WORLD_SIZE=str(len(groups)), LOCAL_RANK=str(rank),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                 PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if group:
            e["KAITIAN_GROUP"] = group
        if run_dir:
            e["KAITIAN_RUN_DIR"] = os.path.join(tmp, "run")
        e.update(env or {})
        log_paths.append(os.path.join(tmp, f"rank{rank}.log"))
        procs.append(start_rank([WORKER, *argv], e, tmp, log_paths[-1]))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
        kill_ranks(procs)
    logs = []
    for path in log_paths:
        with open(path, errors="replace") as fh:
            logs.append(fh.read())
    if hung:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"ranks hung past {timeout}s:\n" + "\n".join(l[-2000:] for l in logs))
    results = {}
    for out in logs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                rec = json.loads(line[len("RESULT "):])
                results[rec["rank"]] = rec
    time.sleep(0.1)
    leftovers = sorted(shm_segments([p.pid for p in procs]))
    if run_dir:
        left_files = os.listdir(os.path.join(tmp, "run")) if os.path.isdir(os.path.join(tmp, "run")) else []
    else:
        left_files = []
    shutil.rmtree(tmp, ignore_errors=True)
    return results, logs, leftovers, left_files


def _no_exception(results, logs, ranks):
    for r in ranks:
        assert r in results, f"rank {r} printed no result:\n{logs[r][-3000:]}"
        assert "exception" not in results[r], f"rank {r} failed:\n{results[r]['exception']}"


@pytest.mark.parametrize("bridge", ["shm", "tcp"])
def test_layout_subgroups_p2p_and_cleanup(bridge):
    groups = ["cpu0", "cpu0", "cpu1", "cpu2"]
    res, logs, leftovers, files = launch(groups, ["layout"], env={"KAITIAN_BRIDGE": bridge})
    _no_exception(res, logs, range(4))
    r0 = res[0]
    assert r0["backend_class"] == "KaitianBackend"
    assert r0["backend_name"] == "kaitian"
    assert r0["bridge"] == bridge
    assert r0["group_names"] == ["cpu0", "cpu1", "cpu2"]
    assert r0["group_of"] == [0, 0, 1, 2]
    assert r0["flat_intra"] is True and r0["has_intra"] is False  # KAITIAN_INTRA=auto: shm path
    assert all(res[r]["allreduce_ok"] for r in range(4))
    assert all(res[r]["sparse_sum"] == [1.0, 1.0, 1.0, 1.0, 8.0] for r in range(4))
    assert res[0]["sub_a_ok"] and res[3]["sub_a_ok"] and res[0]["sub_a_size"] == 2
    assert all(res[r]["sub_b_ok"] for r in (1, 2, 3))
    assert res[1]["sub_b_groups"] == ["cpu0", "cpu1", "cpu2"]
    assert res[3]["p2p_ok"] and res[0]["p2p_any_source"] == [3, [7, 8, 9]]
    # Segments are unlinked as soon as every peer mapped them; nothing on disk either.
    assert all(not res[r]["segments_after_init"] for r in range(4))
    assert leftovers == [] and files == []


def test_intra_gloo_builds_vendor_backend():
    res, logs, leftovers, _ = launch(["cpu0", "cpu0", "cpu1"], ["layout"],
                                     env={"KAITIAN_INTRA": "gloo"})
    _no_exception(res, logs, range(3))
    assert res[0]["flat_intra"] is False
    assert res[0]["has_intra"] is True and res[2]["has_intra"] is False  # 1-rank group: no vendor PG
    assert all(res[r]["allreduce_ok"] for r in range(3))
    assert leftovers == []


@pytest.mark.parametrize("bridge", ["shm", "tcp"])
def test_killed_peer_fails_survivors_fast(bridge):
    # Group timeout 20 s; the error must come long before it (dead pid / closed socket).
    res, logs, leftovers, _ = launch(["cpu0", "cpu1", "cpu1"], ["kill", "2", "30"],
                                     env={"KAITIAN_BRIDGE": bridge, "KT_PG_TIMEOUT": "20"})
    assert 2 not in res  # the victim died without a result
    for r in (0, 1):
        assert r in res, f"rank {r} printed no result:\n{logs[r][-3000:]}"
        assert "exception" not in res[r], res[r]["exception"]
        assert "error" in res[r], f"rank {r} never saw an error"
        assert res[r]["error_after_s"] < 10.0, res[r]
        assert "DistBackendError" in res[r]["error"]
    # Whoever waited on rank 2 names it.
    assert any("rank 2" in res[r]["error"] for r in (0, 1)), [res[r]["error"] for r in (0, 1)]
    assert leftovers == []


def test_wait_timeout_and_group_timeout():
    res, logs, _, _ = launch(["cpu0", "cpu1"], ["waits"])
    _no_exception(res, logs, range(2))
    r0 = res[0]
    assert "Work.wait(timeout=300 ms) expired" in r0["short_wait"], r0["short_wait"]
    assert 0.25 < r0["short_wait_s"] < 1.2, r0["short_wait_s"]
    assert r0["late_result"] == 3.0 and r0["future_value"] == 3.0
    assert "timed out after 1" in r0["group_timeout"], r0["group_timeout"]
    assert 0.9 < r0["group_timeout_s"] < 2.5, r0["group_timeout_s"]
