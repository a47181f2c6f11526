"""Online re-balancing in a real 2-rank job (two simulated vendor groups, backend kaitian)."""

import json

from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail


def _run(*args, timeout=180):
    run = run_ranks(Layout("1+1"), [worker("slowdown"), *args], timeout=timeout)
    try:
        assert run.returncodes == [0, 0] and not run.timed_out, tail(run.logs[0]) + tail(run.logs[1])
        out = []
        for path in run.outs:
            with open(path) as f:
                out.append(json.load(f))
        return out
    finally:
        cleanup(run)


def _unequal_before_the_slowdown(history, slow_from=80, apart=2.0):
    """The rounds before the slowdown whose fitted costs of an equal share (64 samples) are more
    than ``apart`` times apart: the machine, not the script, made one rank slower (CI, this
    host's serial pass beside the other lanes, measured 4.8 against 13.2 ms at step 29). Costs
    up to 2x apart split 43:85 at most, inside the band the test allows; beside a CI run, this
    machine's rounds measured them 1.5-1.7x apart."""
    unequal = []
    for step, _, _, _, fixed, per_sample in history:
        costs = [f + b * 64 for f, b in zip(fixed, per_sample)]
        if step < slow_from and min(costs) > 0 and max(costs) > apart * min(costs):
            unequal.append((step, [round(c, 2) for c in costs]))
    return unequal


def test_split_follows_a_rank_that_slows_down_5x_mid_epoch():
    """Default settings (a round every 25 steps or 10 s): rank 1 becomes 5x slower at
    step 80 of a 240-step epoch; within 3 rounds (75 steps) most of the batch has moved.
    The ranks are of equal speed until then only if the machine lets them be: a run whose
    rounds measured them apart runs once more, and two such runs fail."""
    r0, r1 = _run("--steps", "240", "--slow-from", "80")
    first = _unequal_before_the_slowdown(r0["history"])
    if first:
        r0, r1 = _run("--steps", "240", "--slow-from", "80")
        again = _unequal_before_the_slowdown(r0["history"])
        assert not again, f"the machine made the equal ranks unequal in two runs (step, ms at 64): {first}; {again}"
    assert (r0["every"], r0["seconds"]) == (25, 10.0)
    assert r0["history"] == r1["history"], "ranks disagree on the split"
    assert [a + b for a, b in zip(r0["sizes"], r1["sizes"])] == [128] * 240
    before = r0["sizes"][70:80]
    # Measured within 2x of each other: within 3/8 of an equal split (CI saw 46:82).
    assert all(abs(b - 64) <= 24 for b in before), (before, r0["history"])
    after = sorted(r0["sizes"][80 + 75:])
    # Ideal 5:1 = 107 of 128. Most steps hold most of it; none goes back to an equal split
    # (a round measured while other processes slowed rank 0 may move back part of the way:
    # CI saw 82 after 95).
    assert after[len(after) // 2] >= 0.7 * 128 and after[0] >= 0.6 * 128, (r0["sizes"][80:], r0["history"])
    applied = [h for h in r0["history"] if h[3] and h[0] > 80]
    assert applied and applied[0][0] <= 80 + 50, r0["history"]  # the first move within 2 rounds


def test_every_step_rebalancing_works():
    r0, r1 = _run("--steps", "120", "--slow-from", "10", "--every", "1")
    assert r0["history"] == r1["history"]
    assert len(r0["history"]) >= 50  # a round before (nearly) every step
    assert sum(1 for h in r0["history"] if h[3]) >= 2
    assert r0["sizes"][-1] > 80, r0["sizes"]
