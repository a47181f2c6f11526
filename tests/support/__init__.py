"""Helpers shared by the tests: paths, rank runners, docker fixtures, the collective cases."""

from __future__ import annotations

import os

__all__ = ["REPO", "TESTS", "WORKERS", "worker", "repo_env", "alive"]

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
WORKERS = os.path.join(TESTS, "workers")


def worker(name: str) -> str:
    """The path of the subprocess worker ``tests/workers/<name>.py``."""
    path = os.path.join(WORKERS, f"{name}.py")
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return path


def repo_env(env=None, **extra: str) -> dict:
    """``env`` (default: this process's) with the repo and ``tests/`` first on ``PYTHONPATH``,
    so a subprocess imports this checkout's kaitian and ``support``."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, TESTS, out.get("PYTHONPATH")]))
    out.update(extra)
    return out


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
