"""Exact gradients and re-balancing in real multi-process runs.

Each test starts one job with ``kaitianrun`` (a subprocess, as a user would),
backend ``kaitian``, ranks split into two simulated vendor groups, and checks
what the ranks report.
"""

import json
import os
import subprocess
import sys

import pytest

from support import WORKERS, repo_env
BACKEND = "kaitian"


def _launch(nproc, script, *args, timeout=240):
    env = repo_env()
    # two simulated vendor groups: 1+1 ranks, or 2+1 with three ranks
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", f"--nproc-per-node={nproc}",
           "--cpu-groups=2", os.path.join(WORKERS, script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("nproc", [3])  # 2 ranks: tests/training/test_weighting.py
def test_unequal_batches_match_single_process_training(tmp_path, nproc):
    out = tmp_path / "exact.json"
    _launch(nproc, "exact_grad.py", BACKEND, out)
    ranks = json.loads(out.read_text())
    assert len({r.pop("group") for r in ranks}) == 2, "expected two vendor groups"
    want = {2: [7, 13], 3: [5, 10, 15]}[nproc]  # 10 x world split 1:2(:3)
    for rank, rank_result in enumerate(ranks):
        assert rank_result.pop("env_split") == want
        assert rank_result.pop("optimize_batch_size") == want[rank]
        for case, r in rank_result.items():
            assert r["worst"] < 1e-9, (case, r)
            sizes = [tuple(s) for s in r["sizes"]]
            assert len(set(sum(s) for s in sizes)) == 2, (case, sizes)  # full and short steps
            assert any(len(set(s)) > 1 for s in sizes), (case, sizes)  # really unequal
            assert r["timed_steps"] == r["steps"] and r["compute_positive"]
            assert r["global_samples"] == sorted({sum(s) for s in sizes})


@pytest.mark.parametrize("every", ["epoch"])  # step-driven rounds: test_rebalance_online.py
def test_rebalancing_moves_samples_from_a_slower_rank(tmp_path, every):
    out = tmp_path / "rebalance.json"
    # rank 1 does its hidden layer 3 more times per sample (about 4x the compute) and reports
    # a host reduce speed of a third of rank 0's (the worker's stand-in: a CPU quota does not
    # slow a reduction shorter than the quota's period, so it cannot make one measurably slower)
    _launch(2, "rebalance_run.py", BACKEND, 1, 3, out, every, "slow-reduce")
    ranks = json.loads(out.read_text())
    first = ranks[0]
    for r in ranks:
        assert r["history"] == first["history"], "ranks disagree on the split"
        assert r["final_split"] == first["final_split"]
        assert r["stripes"] == first["stripes"], "ranks disagree on the stripes"
        assert len(set(r["steps"])) == 1, "steps per epoch changed"
    assert first["steps"][0] == ranks[1]["steps"][0]
    fast, slow = first["final_split"]
    assert fast + slow == 128
    assert fast / (fast + slow) >= 0.65, first["history"]
    assert first["history"][0][1] == [64, 64]
    # every step, the two ranks' batches add up to the global batch
    assert [a + b for a, b in zip(first["sizes"], ranks[1]["sizes"])] == [128] * len(first["sizes"])
    if every != "epoch":  # changes land within epochs: more rounds than epoch boundaries
        assert len(first["history"]) >= 8
        assert len(set(first["sizes"][:16])) > 1
    # the stripes follow the ranks' reduce speeds (exchanged in each round): rank 1 reduces a quarter
    # of each all_reduce, and the backend uses those weights
    assert first["stripes"] == [[49152, 16384]] * len(first["history"]), first["stripes"]
    assert first["weights_in_use"] == [49152, 16384]
    for step_cost, old, new, applied in first["history"]:
        assert step_cost[1] > step_cost[0]  # it saw the slow rank (its step at 64 samples costs more)
        if applied:
            assert new[0] > old[0] or abs(new[0] - old[0]) < 20
