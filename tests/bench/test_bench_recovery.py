"""``kaitian bench recovery``: what it counts, and one real small run under continue."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from kaitian.bench.recovery import _measure, _rejoin

from support import REPO


def test_counts_the_step_in_flight_and_every_step_completed_again_after_the_kill():
    args = argparse.Namespace(samples=40, batch_size=2, nproc=2, epochs=1)  # 10 steps of 4
    # a restart: steps 1-5 before the kill (checkpoint after 3), then the restarted job from step 4
    steps = [{"applied": a, "time": a, "life": 0} for a in range(1, 6)]
    steps += [{"applied": a, "time": 10 + a, "life": 1} for a in range(4, 11)]
    assert _measure(steps, killed=5.5, args=args) == {
        "next_s": 14 - 5.5, "back_s": 16 - 5.5, "redone": 3, "samples_lost": 0}
    # continue: the next generation redoes step 6 and goes on; step 9 never trained: one batch lost
    steps = [{"applied": a, "time": a, "life": 0} for a in range(1, 6)]
    steps += [{"applied": a, "time": 6 + a / 10, "life": 1} for a in (6, 7, 8, 10)]
    assert _measure(steps, killed=5.5, args=args) == {
        "next_s": 6.6 - 5.5, "back_s": 6.6 - 5.5, "redone": 1, "samples_lost": 4}


def test_the_rejoin_is_the_restarted_workers_first_step_and_its_parts_add_up():
    """Killed at 10: restarted at 10.5, imported at 12, its device ready at 12.5, its trainer at 13,
    admitted at 14, its first step at 14.25; a worker that never trained gives ``None``."""
    start = {"who": "h_0_1", "started": 10.5, "imported": 12.0, "device_ready": 12.5, "trainer_ready": 13.0,
             "joined": 14.0}
    steps = [{"applied": 20, "time": 13.0, "who": "h_1_0"}, {"applied": 21, "time": 14.25, "who": "h_0_1"}]
    got = _rejoin([start], steps, killed=10.0)
    assert got["rejoin_s"] == 4.25 and sum(got["rejoin_parts"].values()) == 4.25
    assert list(got["rejoin_parts"]) == ["process started", "torch and kaitian imported", "device ready",
                                         "optimizer and trainer built", "admitted, state received", "first step"]
    assert _rejoin([start], steps[:1], killed=10.0)["rejoin_s"] is None
    assert _rejoin([], steps, killed=10.0) == {"rejoin_s": None, "rejoin_parts": {}}


def test_small_run_under_continue(tmp_path):
    results = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "kaitian", "bench", "recovery", "--modes", "continue", "--repeats", "1",
         "--samples", "1920", "--hidden", "64", "--kill-at", "8", "--json", str(results)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kaitianrun --on-failure continue" in proc.stdout
    (run,) = json.loads(results.read_text())["runs"]["continue"]
    assert run["redone"] == 1 and run["samples_lost"] == 0 and 0 < run["next_s"] <= run["back_s"]
