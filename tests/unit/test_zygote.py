"""The test support's forked ranks (support/zygote.py) against fresh interpreters.

A rank forked from the zygote must look to its script exactly as ``python
script`` would: the same report from the probe, started both ways. Its end is
seen by ``poll`` and ``wait``; a run that hangs is dumped and killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from support import TESTS, worker
from support.ranks import Layout, cleanup, run_ranks, tail
from support.zygote import start_rank


def _probe(tmp_path, monkeypatch, fresh: bool, mode: str) -> tuple:
    monkeypatch.setenv("KT_FRESH_RANKS", "1" if fresh else "0")
    out, log = tmp_path / f"report-{fresh}", tmp_path / f"log-{fresh}"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": TESTS, "KT_PROBE": "yes", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    rank = start_rank([worker("zygote_probe"), str(out), mode], env, str(tmp_path), str(log))
    returncode = rank.wait(timeout=60)
    report = json.loads(out.read_text())
    report["env"] = {k: v for k, v in report["env"].items() if k != "LC_CTYPE"}  # Python may coerce the C locale
    return returncode, report, log.read_text(), (tmp_path / f"report-{fresh}.atexit").exists(), rank.pid


@pytest.mark.parametrize("mode,returncode", [("exit3", 3), ("raise", 1), ("killed", -9)])
def test_a_forked_rank_is_what_a_fresh_interpreter_would_be(tmp_path, monkeypatch, mode, returncode):
    fresh = _probe(tmp_path, monkeypatch, True, mode)
    forked = _probe(tmp_path, monkeypatch, False, mode)
    for got in (fresh, forked):
        rc, report, log, atexit_ran, pid = got
        assert rc == returncode and atexit_ran == (mode != "killed"), (rc, log)
        assert report["own_session"] and report["stdin"] == "" and report["threads"] == 1
        assert not report["kaitian_imported"] and report["name"] == "__main__"
        assert "to stdout" in log and "to stderr" in log
        assert ("ValueError: the probe raised" in log) == (mode == "raise")
    # every field but the report file's own name
    assert {k: v for k, v in forked[1].items() if k != "argv"} == {k: v for k, v in fresh[1].items() if k != "argv"}
    assert forked[1]["argv"][2:] == fresh[1]["argv"][2:]


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "forked"])
def test_poll_and_wait_see_a_rank_end(tmp_path, monkeypatch, fresh):
    monkeypatch.setenv("KT_FRESH_RANKS", "1" if fresh else "0")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": TESTS}
    ends, hangs = (start_rank([worker("zygote_probe"), str(tmp_path / mode), mode], env, str(tmp_path),
                              str(tmp_path / f"{mode}.log")) for mode in ("exit3", "hang"))
    deadline = time.monotonic() + 60
    while ends.poll() is None and time.monotonic() < deadline:  # poll() alone must see the end
        time.sleep(0.05)
    assert ends.returncode == 3
    with pytest.raises(subprocess.TimeoutExpired):
        hangs.wait(timeout=0.5)
    assert hangs.poll() is None
    os.killpg(hangs.pid, signal.SIGKILL)
    assert hangs.wait(timeout=60) == -signal.SIGKILL


def test_ranks_that_hang_past_the_timeout_dump_their_stacks_and_are_killed(tmp_path):
    run = run_ranks(Layout("1+1"), [worker("zygote_probe"), str(tmp_path / "report"), "hang"], timeout=3)
    try:
        assert run.timed_out and run.returncodes == [-signal.SIGKILL] * 2, run.returncodes
        assert all("in <module>" in tail(log) for log in run.logs)  # the stacks dumped first
    finally:
        cleanup(run)
