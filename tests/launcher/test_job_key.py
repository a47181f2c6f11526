"""kaitianrun hands every job a bridge key (``KAITIAN_JOB_KEY``) its workers prove on the TCP bridge."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENVDUMP = os.path.join(REPO, "tests", "workers", "envdump.py")


def _kaitianrun(out, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("USE_", "KAITIAN_", "PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.update(extra)
    os.makedirs(out, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "kaitian.launcher.cli", "--nproc-per-node", "2", ENVDUMP, out],
                          env=env, capture_output=True, text=True, timeout=120)
    keys = [json.load(open(p)).get("KAITIAN_JOB_KEY") for p in sorted(glob.glob(os.path.join(out, "env.*.json")))]
    return proc, keys


def test_each_job_gets_its_own_key(tmp_path):
    first, keys1 = _kaitianrun(str(tmp_path / "a"))
    second, keys2 = _kaitianrun(str(tmp_path / "b"))
    assert first.returncode == second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
    assert len(keys1) == len(keys2) == 2
    assert keys1[0] == keys1[1] and keys2[0] == keys2[1]  # shared by the job's workers
    assert re.fullmatch(r"[0-9a-f]{64}", keys1[0]) and keys1[0] != keys2[0]


def test_a_given_key_is_passed_on_and_a_short_one_refused(tmp_path):
    given = "scheduler-made-key-0123456789"
    proc, keys = _kaitianrun(str(tmp_path / "a"), KAITIAN_JOB_KEY=given)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert keys == [given, given]
    proc, keys = _kaitianrun(str(tmp_path / "b"), KAITIAN_JOB_KEY="short")
    assert proc.returncode == 2 and keys == []
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "KAITIAN_JOB_KEY is too short (5 characters)" in lines[0], proc.stderr
