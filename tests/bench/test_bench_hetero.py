"""``kaitian bench hetero`` end to end, small: its progress, its table, and its timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from support import REPO

SMALL = ["--quota", "1", "--gap", "1", "--batch-size", "8", "--hidden", "16", "--features", "8", "--steps", "1",
         "--pairs", "1"]


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "kaitian", "bench", "hetero", *SMALL, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _workers() -> list:
    return subprocess.run(["pgrep", "-f", "kaitian.bench.hetero --worker"], capture_output=True, text=True).stdout.split()


def test_a_small_run_shows_each_cycle_then_the_table(tmp_path):
    proc = _bench("--cycles", "2", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert 0 <= out.index("cycle 1/2 done") < out.index("cycle 2/2 done") < out.index("ideal (best subset)")
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["world"] == 2 and sorted(result["history"]) == sorted(["solo", "alone", "local", "equal", "static",
                                                                          "rebalance"])
    assert all(len(result["history"][m]) == 2 for m in ("equal", "static", "rebalance"))


def test_a_job_past_its_timeout_is_stopped_with_its_workers():
    started = time.monotonic()
    proc = _bench("--cycles", "1000", "--timeout", "15", timeout=200)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ran past --timeout 15 s" in proc.stderr
    assert time.monotonic() - started < 120
    assert _workers() == []
