"""A config file that is not UTF-8: one line naming the file, never a traceback,
from `kaitian devices`, `kaitian init`, `kaitian init -r` and kaitianrun (issue 20)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import REPO, TESTS, worker


def _run(args, config, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAITIAN_", "USE_", "PET_"))}
    env.update(KAITIAN_CONFIG=str(config), PYTHONPATH=os.pathsep.join([REPO, TESTS]))
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def bad_config(tmp_path):
    path = tmp_path / "config.toml"
    path.write_bytes(b'[devices."cpu:0"]\ncapability = 1.0\n# \xff\xfe not utf-8\n')
    return path


def _one_line_naming(stderr: str, path) -> None:
    assert "Traceback" not in stderr, stderr
    lines = [l for l in stderr.splitlines() if str(path) in l]
    assert len(lines) == 1 and "UTF-8" in lines[0], stderr


def test_kaitian_devices_names_the_bad_config(bad_config):
    proc = _run([sys.executable, "-m", "kaitian", "devices", "--cpu-slots", "1"], bad_config)
    assert proc.returncode == 0, proc.stderr
    _one_line_naming(proc.stderr, bad_config)


def test_kaitian_init_refuses_the_bad_config(bad_config):
    proc = _run([sys.executable, "-m", "kaitian", "init", "--cpu-slots", "1"], bad_config)
    assert proc.returncode == 2, proc.stderr
    _one_line_naming(proc.stderr, bad_config)


def test_kaitian_init_refresh_rewrites_the_bad_config(bad_config):
    proc = _run([sys.executable, "-m", "kaitian", "init", "-r", "--cpu-slots", "1", "--devices", "cpu:0",
                 "--seconds", "0.2"], bad_config)
    assert proc.returncode == 0, proc.stderr
    _one_line_naming(proc.stderr, bad_config)
    bad_config.read_text(encoding="utf-8")  # rewritten, valid


def test_kaitianrun_warns_naming_the_bad_config(bad_config, tmp_path):
    proc = _run([sys.executable, "-m", "kaitian.launcher.cli", "--nproc-per-node", "1",
                 worker("envdump"), str(tmp_path)], bad_config)
    assert proc.returncode == 0, proc.stderr
    _one_line_naming(proc.stderr, bad_config)
