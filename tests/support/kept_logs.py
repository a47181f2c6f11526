"""Checks that a failed kaitianrun kept its default log directory (any runtime)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import List

__all__ = ["KEPT", "RUN_BASE", "run_dirs", "assert_logs_kept_after_failure", "remove_new_kept_logs"]

RUN_BASE = os.path.join(tempfile.gettempdir(), f"kaitian-{os.getuid()}")
KEPT = re.compile(r"^kaitianrun: the workers' logs are kept in (\S+)$", re.M)


def run_dirs(pid: int) -> List[str]:
    """The run directories (names) the agent with ``pid`` left in the base directory."""
    return [d for d in os.listdir(RUN_BASE) if f".{pid}." in d] if os.path.isdir(RUN_BASE) else []


def assert_logs_kept_after_failure(proc, stderr: str) -> None:
    """The kept directory is printed last, holds both ranks' output (the
    ``docker_train`` worker's crash mode), and is no longer a run a later agent
    would collect. Removes it."""
    assert proc.returncode == 1, stderr[-2000:]
    match = KEPT.search(stderr)
    assert match, stderr[-2000:]
    # the last line, after torchrun's summary, and no launcher traceback to bury it
    assert stderr.rstrip().splitlines()[-1] == match.group(0), stderr[-2000:]
    assert "Root Cause (first observed failure)" in stderr and "ChildFailedError" not in stderr, stderr[-2000:]
    kept = match.group(1)
    try:
        assert os.path.isdir(kept) and run_dirs(proc.pid) == [os.path.basename(os.path.dirname(kept))]
        assert os.listdir(os.path.dirname(kept)) == ["logs"]  # run state gone, logs stay
        logs = {p: open(p).read() for p in glob.glob(os.path.join(kept, "**", "stdout.log"), recursive=True)}
        assert any("crash-log from rank 0" in text for text in logs.values()), logs
        assert any("crash-log from rank 1" in text for text in logs.values()), logs
        from kaitian.launcher.rundir import collect_stale

        collect_stale()  # what the next agent does when it starts
        assert os.path.isdir(kept)
    finally:
        shutil.rmtree(os.path.dirname(kept), ignore_errors=True)


def remove_new_kept_logs(before: set) -> None:
    """Removes kept-log run directories that appeared since ``before`` (a listing
    of the base directory): tests of failing runs must not leave them behind."""
    if not os.path.isdir(RUN_BASE):
        return
    for d in set(os.listdir(RUN_BASE)) - before:
        path = os.path.join(RUN_BASE, d)
        try:
            if os.listdir(path) == ["logs"]:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
