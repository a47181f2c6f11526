"""The lease command's dry run on the fake MLU (``scripts/lease_check.py --dry-run``),
every part but the device checks and the copy ceiling (which reads their bridge
bandwidth): test_device_path.py runs those two in the serial pass (per-phase
watchdogs, the step clock); these parts only report numbers on the fake MLU,
so they run beside other tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from support import REPO, repo_env

# the lease command's parts, in order, on the fake MLU, device and copy left to test_device_path.py
PARTS = ["build", "lightning", "accelerate", "hf_trainer", "demo 64", "rejoin", "collectives 4"]
SKIPPED = {"build", "lightning", "accelerate"}  # built already; one trainer in a dry run
LEASE = [sys.executable, os.path.join(REPO, "scripts", "lease_check.py"), "--dry-run"]


def _failed_logs(out) -> str:
    """The end of every log of the lease's folder (the failed parts' among them): pytest removes it later."""
    return "".join(f"\n--- {log.name}:\n" + log.read_text(errors="replace")[-3000:] for log in sorted(out.glob("*.log")))


def test_the_lease_command_dry_runs_on_the_fake_mlu(tmp_path) -> None:
    """Every part ran on the fake MLU and passed (the build is skipped: CI built the
    extension; one trainer of three), each said what it measured (the device's worker
    rejoined, the collectives against gloo), and the summary is in the logs' folder."""
    out = tmp_path / "lease"
    run = subprocess.run([*LEASE, "--parts", "build,lightning,accelerate,hf_trainer,demo,rejoin,collectives",
                          "--out", str(out)], env=repo_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    lines = re.findall(r"^(PASS|FAIL|SKIP) +(\S+(?: \d+)?) +\d+ s  (.*)$", run.stdout, re.M)
    parts = {name: (verdict, note) for verdict, name, note in lines}
    assert run.returncode == 0 and list(parts) == PARTS, run.stdout[-4000:] + run.stderr[-3000:] + _failed_logs(out)
    assert all(verdict == ("SKIP" if p in SKIPPED else "PASS") for p, (verdict, _) in parts.items()), parts
    assert "ratio" in parts["demo 64"][1] and "rejoined" in parts["rejoin"][1], parts
    assert re.search(r"allreduce busbw vs gloo: 1 MiB [\d.]+ GB/s = [\d.]+x", parts["collectives 4"][1]), parts
    assert (out / "summary.txt").read_text() in run.stdout


def test_an_unknown_part_is_one_line_and_leaves_no_folder(tmp_path) -> None:
    out = tmp_path / "lease"
    run = subprocess.run([*LEASE, "--parts", "device,demos", "--out", str(out)], env=repo_env(),
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.strip().splitlines() == [
        "lease_check: no part named demos (parts: build, device, lightning, accelerate, hf_trainer, demo, rejoin, "
        "copy, collectives)"]
    assert not out.exists()
