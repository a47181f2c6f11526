"""Ending a benchmark's job: the process it started in its own session, and all that runs in it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_session(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Ends ``proc`` (started with ``start_new_session=True``) and every process of its session.

    With ``grace_s`` the session first gets SIGTERM, as a terminal's Ctrl-C reaches a foreground job
    (kaitianrun stops its workers and cleans up); whatever still runs after ``grace_s`` seconds, or
    at once without it, gets SIGKILL.
    """
    with contextlib.suppress(ProcessLookupError):  # (the session ended by itself)
        if grace_s > 0 and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
