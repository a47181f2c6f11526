"""A device request that matches nothing stops kaitianrun with one line, before any worker starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import REPO

from kaitian.devices.vendors import nvidia


@pytest.mark.parametrize(
    "extra_env, flags, says",
    [
        ({}, ["--devices", "cuda"], "--devices cuda: no cuda device found on this host"),
        ({"USE_CUDA": "0"}, [], "USE_CUDA=0: no such device 0: no cuda device found on this host"),
    ],
)
def test_request_for_absent_gpus_is_a_one_line_error(tmp_path, extra_env, flags, says):
    if nvidia.probe():
        pytest.skip("this host has an NVIDIA GPU")
    marker = tmp_path / "ran"
    script = tmp_path / "t.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "USE_CUDA", "USE_CPU")}
    env.update(extra_env, PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-auto", *flags, str(script)],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert not marker.exists()
