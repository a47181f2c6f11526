"""A full /dev/shm is ENOSPC with the documented message on every rank, never a
SIGBUS at the first touch, and leaves no segment (issue 20). Runs in a private
64 MiB tmpfs mounted over /dev/shm in a private mount namespace (root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from support import REPO, TESTS, worker

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare for a private /dev/shm")


def test_full_dev_shm_is_enospc_with_the_hint_on_every_rank(tmp_path):
    script = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {worker('shm_full')}"
    env = dict(os.environ, KT_WORKDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([REPO, TESTS]))
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for rank in ("0", "1"):
        err = out["errors"][rank]
        assert err and "No space left on device" in err and "is /dev/shm full?" in err, out
        assert "\n" not in err.strip(), err
    assert out["left"] == [], out
