"""A failed run keeps its default log directory (and says where); only a
successful one, or one whose workers wrote nothing, removes it. kaitianrun with
-r 3 and no --log-dir, local runtime (the docker runtime's twin is in
tests/docker/test_docker_e2e.py)."""

from __future__ import annotations

import glob
import subprocess
import sys

from support import repo_env, worker
from support.kept_logs import KEPT, assert_logs_kept_after_failure, run_dirs

SCRIPT = worker("docker_train")


def _run(tmp_path, mode, *flags):
    env = repo_env(DOCKER_E2E_OUT=str(tmp_path), DOCKER_E2E_MODE=mode, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.2", "-r", "3", *flags, SCRIPT]
    return subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_failed_run_keeps_its_logs_and_says_where(tmp_path):
    proc = _run(tmp_path, "crash")
    _, stderr = proc.communicate(timeout=180)
    assert "exitcode  : 3" in stderr
    assert_logs_kept_after_failure(proc, stderr)


def test_successful_run_removes_its_logs(tmp_path):
    proc = _run(tmp_path, "ok")
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-2000:]
    assert not KEPT.search(stderr)
    assert run_dirs(proc.pid) == []


def test_a_users_log_dir_is_theirs(tmp_path):
    """With --log-dir the logs are already where the user asked; nothing is kept in the run directory."""
    log_dir = tmp_path / "mylogs"
    proc = _run(tmp_path, "crash", "--log-dir", str(log_dir))
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1 and not KEPT.search(stderr)
    assert run_dirs(proc.pid) == []
    assert glob.glob(str(log_dir / "**" / "stdout.log"), recursive=True)


def test_a_failed_run_whose_workers_wrote_nothing_keeps_nothing(tmp_path):
    """Its log files are all empty: nothing to read, so nothing is kept or announced."""
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.2", "-r", "3", "--no-python", "sh", "-c", "exit 3"]
    proc = subprocess.Popen(cmd, env=repo_env(), cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1 and "exitcode  : 3" in stderr, stderr[-2000:]
    assert not KEPT.search(stderr), stderr[-2000:]
    assert run_dirs(proc.pid) == []
