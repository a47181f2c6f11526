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


# Before the slowdown the split stays within this many samples of an equal 64:64.
_BAND = 24


def _unequal_before_the_slowdown(history, slow_from=80, band=_BAND):
    """The rounds before the slowdown whose fitted step costs, fixed part included, balance
    the 128 samples more than ``band`` away from an equal split: the machine, not the script,
    made one rank slower (CI's serial pass beside the other lanes once measured 4.8 against
    13.2 ms at step 29). Costs not far apart at 64 samples can balance far from it: a CI round's
    0.96 ms fixed + 0.08 ms a sample against 0.21 ms a sample, 2.2x apart, balance at 89:39."""
    unequal = []
    for step, _, _, _, (f0, f1), (b0, b1) in history:
        if step < slow_from and b0 > 0 and b1 > 0:
            balanced = (f1 + b1 * 128 - f0) / (b0 + b1)  # rank 0's share: f0 + b0 a = f1 + b1 (128 - a)
            if abs(balanced - 64) > band:
                unequal.append((step, round(balanced)))
    return unequal


def test_split_follows_a_rank_that_slows_down_5x_mid_epoch():
    """Default settings (a round every 25 steps or 10 s): rank 1 becomes 5x slower at
    step 80 of a 240-step epoch; within 3 rounds (75 steps) most of the batch has moved.
    The ranks are of equal speed until then only if the machine lets them be: a run whose
    rounds measured them apart runs again, and three such runs fail (CI's serial pass beside
    the other lanes once measured rank 1 the faster in one run and rank 0 in the next)."""
    unequal = []
    for _ in range(3):
        r0, r1 = _run("--steps", "240", "--slow-from", "80")
        unequal.append(_unequal_before_the_slowdown(r0["history"]))
        if not unequal[-1]:
            break
    assert not unequal[-1], f"the machine made the equal ranks unequal in every run (step, rank 0's share): {unequal}"
    assert (r0["every"], r0["seconds"]) == (25, 10.0)
    assert r0["history"] == r1["history"], "ranks disagree on the split"
    assert [a + b for a, b in zip(r0["sizes"], r1["sizes"])] == [128] * 240
    before = r0["sizes"][70:80]
    # Measured to balance within 3/8 of an equal split, the split stays there (CI saw 46:82).
    assert all(abs(b - 64) <= _BAND for b in before), (before, r0["history"])
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
