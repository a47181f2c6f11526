"""The benches' end of a job: its session's processes, gone whichever way they take SIGTERM."""

import subprocess
import time

from kaitian.bench.session import stop_session


def _session(script: str, tmp_path) -> tuple:
    """``script`` under sh in its own session; it starts a grandchild that writes its pid first."""
    pid_file = tmp_path / "grandchild"
    proc = subprocess.Popen(["sh", "-c", f"sleep 600 & echo $! > {pid_file}; {script}"], start_new_session=True)
    while not pid_file.exists() or not pid_file.read_text().strip():
        time.sleep(0.01)
    return proc, int(pid_file.read_text())


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` ends within ``within_s`` (a SIGKILL takes effect when the process next runs)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:  # (a zombie, left for its reaper, is gone too)
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.01)
    return False


def test_a_job_that_stops_on_sigterm_stops_within_its_grace_and_takes_its_session_along(tmp_path):
    proc, grandchild = _session("trap 'exit 3' TERM; while :; do sleep 0.05; done", tmp_path)
    started = time.monotonic()
    stop_session(proc, grace_s=30)
    assert proc.returncode == 3 and time.monotonic() - started < 10  # its own SIGTERM handler ran
    assert _gone(grandchild)


def test_a_job_that_ignores_sigterm_is_killed_after_its_grace(tmp_path):
    proc, grandchild = _session("trap '' TERM; while :; do sleep 0.05; done", tmp_path)
    started = time.monotonic()
    stop_session(proc, grace_s=0.5)
    assert proc.returncode == -9 and 0.5 <= time.monotonic() - started < 10
    assert _gone(grandchild)


def test_without_a_grace_the_session_is_killed_at_once_and_an_ended_job_is_fine(tmp_path):
    proc, grandchild = _session("while :; do sleep 0.05; done", tmp_path)
    stop_session(proc)
    assert proc.returncode == -9 and _gone(grandchild)
    done = subprocess.Popen(["true"], start_new_session=True)
    done.wait()
    stop_session(done, grace_s=5)
    assert done.returncode == 0
