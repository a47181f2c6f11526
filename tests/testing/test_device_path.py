"""kaitian's device path on the fake accelerator: ``scripts/cuda_check.py --device mlu``,
the GPU check run on fake MLUs beside CPU ranks, one job per layout whose output
each test reads, phase by phase (see the script's docstring for what each phase
checks):

- one fake MLU rank (alone in its group) + two CPU ranks: every phase, as the
  device part of the lease command's dry run (``scripts/lease_check.py
  --dry-run --parts device,copy``: the copy part reads the device part's
  bridge bandwidth; the other parts run in the parallel pass, test_lease.py);
- two fake MLU ranks (one fake-CNCL group) + one CPU rank: every phase, after
  the harness's own test (checks that fail or hang on one rank, a phase
  stopped on one rank: each costs itself alone, and every phase after it passes);
- two fake MLU ranks and nothing else (the vendor alone runs each op): the
  ops, staging and fail-stop phases; fail-stop again over the TCP bridge.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from support import REPO, repo_env

pytest.importorskip("kaitian.testing._fake_accelerator", reason="the fake accelerator needs torch 2.13+")

# checks each phase reports (a phase that silently skips one fails too)
CHECKS = {"ops": 80, "sizes": 9, "streams": 4, "memory": 6, "training": 6, "clock": 6, "failstop": 5,
          "kaitianrun": 1}
# layout -> (device ranks, CPU ranks, phases, bridge); 1+2 is the lease dry run's device part
EVERY = "ops,sizes,streams,memory,training,clock,failstop"
LAYOUTS = {"2+1": (2, 1, f"harness,{EVERY}", "auto"),
           "2+0": (2, 0, "ops,memory,failstop", "auto"), "2+0 tcp": (2, 0, "failstop", "tcp")}
# a world of two has no rank 2 to broadcast from (one check per broadcast dtype)
FEWER = {("2+0", "ops"): 4}


@functools.lru_cache(maxsize=None)
def _lease_device() -> tuple:
    """``scripts/lease_check.py --dry-run --parts device,copy``: its run and its folder of logs (removed at exit)."""
    out = tempfile.mkdtemp(prefix="kaitian-lease-dry-run-")
    atexit.register(shutil.rmtree, out, True)
    run = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "lease_check.py"), "--dry-run",
                          "--parts", "device,copy", "--out", out],
                         env=repo_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    return run, out


@functools.lru_cache(maxsize=None)
def _run(layout: str) -> subprocess.CompletedProcess:
    if layout == "1+2":  # the lease's device part: its log is the check's output
        lease, out = _lease_device()
        with open(os.path.join(out, "device.log")) as f:
            log = f.read()
        return subprocess.CompletedProcess(lease.args, 0 if "all checks passed" in log else 1, log, lease.stdout)
    devices, cpus, phases, bridge = LAYOUTS[layout]
    # no bandwidth table; 20 MiB reductions still span two 16 MiB segments
    cmd = [sys.executable, os.path.join(REPO, "scripts", "cuda_check.py"), "--device", "mlu", "--sizes", "",
           "--big-mib", "20", "--device-ranks", str(devices), "--cpu-ranks", str(cpus), "--bridge", bridge,
           "--phases", phases]
    return subprocess.run(cmd, env=repo_env(), capture_output=True, text=True, timeout=600, cwd=REPO)


def _phase(layout: str, name: str) -> None:
    run = _run(layout)
    lines = re.findall(rf"^(PASS|FAIL)  {name}[: ](.*)$", run.stdout, re.M)
    failed = [check for verdict, check in lines if verdict == "FAIL"]
    expected = CHECKS[name] - FEWER.get((layout, name), 0)
    assert not failed and len(lines) == expected, (
        f"{layout} {name}: {len(lines)} checks reported (expected {expected}), failed: {failed}\n"
        f"{run.stdout[-6000:]}\n{run.stderr[-4000:]}")


LAID_OUT = ["1+2", "2+1"]


@pytest.mark.parametrize("layout", LAID_OUT)
@pytest.mark.parametrize("phase", ["ops", "sizes", "streams"])
def test_collectives_on_the_device(layout: str, phase: str) -> None:
    _phase(layout, phase)


@pytest.mark.parametrize("layout", LAID_OUT)
def test_freed_memory_barrier_second_device_and_staging(layout: str) -> None:
    _phase(layout, "memory")


@pytest.mark.parametrize("layout", LAID_OUT)
def test_training_is_exact_and_timed_on_the_device(layout: str) -> None:
    _phase(layout, "training")
    _phase(layout, "clock")


@pytest.mark.parametrize("layout", LAID_OUT)
def test_fail_stop_on_the_device(layout: str) -> None:
    _phase(layout, "failstop")


def test_the_vendor_alone_stages_nothing_and_fails_stop() -> None:
    """Every rank in one vendor group: the fake CNCL runs each op, yet kaitian's
    deadline, fail-stop and dead-peer naming hold (its bridge watches the peers)."""
    for phase in ("ops", "memory", "failstop"):
        _phase("2+0", phase)
    _phase("2+0 tcp", "failstop")


# the harness's checks that fail (rank 0 fails while the others wait in gloo, then in
# kaitian; the last rank hangs; the last rank stops the phase before its last check)
HARNESS_FAILS = ["fails on rank 0 alone, the others wait for it in gloo",
                 "fails on rank 0 alone, the others wait for it in kaitian", "hangs on the last rank alone",
                 "the other ranks go on after the last one stopped this phase"]


def test_a_check_failing_or_hanging_on_one_rank_costs_itself_alone() -> None:
    run = _run("2+1")
    lines = dict((check, verdict) for verdict, check in re.findall(r"^(PASS|FAIL)  harness: (.*?)(?:  \(.*)?$",
                                                                    run.stdout, re.M))
    assert lines == {**{name: "FAIL" for name in HARNESS_FAILS}, "collectives on every group after them": "PASS"}, \
        f"{lines}\n{run.stdout[-6000:]}\n{run.stderr[-4000:]}"
    assert re.search(r"FAIL  harness: fails on rank 0 alone, the others wait for it in gloo  \(rank 0: ValueError",
                     run.stdout), run.stdout[-3000:]
    assert re.search(r"FAIL  harness: hangs on the last rank alone  \(rank 2: hung", run.stdout), run.stdout[-3000:]
    failed = re.findall(r"^FAILED  (.*)$", run.stdout, re.M)  # the summary
    assert failed == [f"harness: {name}" for name in HARNESS_FAILS] + ["harness stopped on rank 2"], \
        f"{failed}\n{run.stdout[-3000:]}"
    assert run.returncode == 1 and "FAILED in" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("layout", ["1+2", "2+1", "2+0", "2+0 tcp"])
def test_kaitianrun_nproc_auto_and_the_whole_check_passes(layout: str) -> None:
    _phase(layout, "kaitianrun")
    if layout == "2+1":  # the harness's failures are its own test's
        return
    run = _run(layout)
    assert run.returncode == 0 and "all checks passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_the_lease_command_checks_the_device_then_the_copy_ceiling() -> None:
    """The lease command's device part passed (its checks are the 1+2 layout's tests) and its
    copy part set the bridge beside the device's pinned copies; the summary is in the logs' folder."""
    run, out = _lease_device()
    lines = re.findall(r"^(PASS|FAIL|SKIP) +(\S+) +\d+ s  (.*)$", run.stdout, re.M)
    parts = {name: (verdict, note) for verdict, name, note in lines}
    assert run.returncode == 0 and list(parts) == ["device", "copy"], run.stdout[-4000:] + run.stderr[-3000:]
    assert parts["device"][0] == "PASS" and parts["copy"][0] == "PASS", parts
    assert re.search(r"bridge all_reduce 4 MiB busbw [\d.]+ GB/s = [\d.]+x the slower copy", parts["copy"][1]), parts
    assert open(os.path.join(out, "summary.txt")).read() in run.stdout
