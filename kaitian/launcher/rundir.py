"""Per-node run directories (``KAITIAN_RUN_DIR``) and what a killed agent left behind.

Each agent owns one owner-only directory ``$TMPDIR/kaitian-<uid>/<run>.<pid>``.
It holds the default log directory, one sub-directory per worker-group start
(the ``KAITIAN_RUN_DIR`` of that start's workers: the backend's FileStore and
shared-memory names live there) and two small records: the agent's identity
and the current workers' pids. The next agent that starts on the host reads
those records; if their agent is gone it kills the workers it left running
and removes the directory.

A run that fails keeps its worker logs: ``finish(succeeded=False)`` removes
everything but the default log directory and the agent record, so the
directory is no longer a run to collect; only a successful run, or one whose
workers wrote nothing to read, removes it all.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import tempfile
from typing import Dict, List, Optional

from kaitian.errors import RunDirError

__all__ = ["RunDir", "base_dir", "collect_stale", "process_alive", "process_start_time", "record_pid_namespace"]

logger = logging.getLogger(__name__)

_AGENT_FILE = "agent.json"
_WORKERS_FILE = "workers.json"
_NAMESPACES_FILE = "pid-namespaces.json"


def base_dir() -> str:
    """``$TMPDIR/kaitian-<uid>``, created owner-only (never readable or writable by others).

    Checked through a descriptor opened without following links: a symlink or a
    directory another user planted under our name is refused, never chmodded.
    """
    path = os.path.join(tempfile.gettempdir(), f"kaitian-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        what = "a symbolic link" if os.path.islink(path) else "not a directory"
        raise RunDirError(
            f"{path} is {what} ({e.strerror}); remove it or set TMPDIR to a private directory"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise RunDirError(
                f"{path} belongs to uid {st.st_uid}, not {os.getuid()}; "
                "set TMPDIR to a private directory"
            )
        if st.st_mode & 0o066:  # search-only (0711) is allowed: kept containers of another user traverse it
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def process_start_time(pid: int) -> Optional[float]:
    """The process's start time (clock ticks since boot), ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return float(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int, start_time: Optional[float]) -> bool:
    """Whether ``pid`` runs and, given its start time, is still that process (a recycled pid is not it)."""
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def _write_json(path: str, data: object) -> None:
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class RunDir:
    """This agent's run directory.

    Args:
        run_id: the rendezvous run id (part of the directory name).
    """

    def __init__(self, run_id: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64] or "run"
        self.path = tempfile.mkdtemp(prefix=f"{safe}.{os.getpid()}.", dir=base_dir())
        os.chmod(self.path, 0o700)
        _write_json(
            os.path.join(self.path, _AGENT_FILE),
            {"pid": os.getpid(), "start_time": process_start_time(os.getpid())},
        )
        self._starts = 0
        self._current: Optional[str] = None

    @property
    def log_dir(self) -> str:
        """Default ``--log-dir`` (removed after a successful run, kept after a failed one)."""
        path = os.path.join(self.path, "logs")
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def new_start(self) -> str:
        """A fresh ``KAITIAN_RUN_DIR`` for the next worker-group start.

        The previous start's directory is removed: its workers are stopped by
        then, and a backend must never find a previous attempt's FileStore.
        """
        if self._current:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = os.path.join(self.path, f"start{self._starts}")
        self._starts += 1
        os.makedirs(self._current, mode=0o700)
        return self._current

    def record_workers(self, pids: Dict[int, int]) -> None:
        """Remembers the running workers, so a later agent can stop them if this one is killed."""
        _write_json(
            os.path.join(self.path, _WORKERS_FILE),
            [[pid, process_start_time(pid)] for pid in pids.values()],
        )

    def remove(self) -> None:
        """Deletes the directory (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def finish(self, succeeded: bool) -> Optional[str]:
        """Ends the run: removes the directory, or after a failure keeps the default logs.

        Args:
            succeeded: whether the job finished successfully.

        Returns:
            The kept log directory, or ``None`` (success, or every log file empty: a
            directory of empty files would only be left behind).
        """
        logs = os.path.join(self.path, "logs")
        kept = not succeeded and any(_size(os.path.join(d, f)) for d, _, files in os.walk(logs) for f in files)
        if not kept:
            self.remove()
            return None
        for name in os.listdir(self.path):
            if name != "logs":  # with agent.json gone, no later agent collects it
                path = os.path.join(self.path, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
        return logs


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def record_pid_namespace(run_dir: str, pid_ns: int) -> None:
    """Remembers a container's pid namespace (the docker runtime's), so a later
    agent removes the shared memory its workers left if this agent is killed:
    the container then removes itself, but its segments stay in the host's IPC."""
    path = os.path.join(run_dir, _NAMESPACES_FILE)
    try:
        with open(path) as f:
            known = list(json.load(f))
    except (OSError, ValueError):
        known = []
    if pid_ns not in known:
        _write_json(path, known + [pid_ns])


def _live_pid_namespaces() -> set:
    """The pid namespaces (inodes) of the processes this host lets us see."""
    from kaitian.backend.shm_gc import pid_namespace

    return {pid_namespace(entry) for entry in os.listdir("/proc") if entry.isdigit()} - {0}


def _collect_namespaces(path: str) -> None:
    """Removes the shared memory of the dead container namespaces a run recorded."""
    from kaitian.backend.shm_gc import collect_namespace_segments

    try:
        with open(os.path.join(path, _NAMESPACES_FILE)) as f:
            namespaces = json.load(f)
    except (OSError, ValueError):
        return
    live = _live_pid_namespaces()
    for ns in namespaces:
        if int(ns) in live:
            continue  # the number was reused by a namespace that is alive now
        for name in collect_namespace_segments(int(ns)):
            logger.warning("removed shared memory %s left by a killed kaitianrun agent's container", name)


def collect_stale() -> List[str]:
    """Removes run directories whose agent is gone, killing workers it left running.

    Returns:
        The directories removed.
    """
    removed: List[str] = []
    try:
        base = base_dir()
        entries = os.listdir(base)
    except OSError:
        return removed
    for name in entries:
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, _AGENT_FILE)) as f:
                agent = json.load(f)
        except (OSError, ValueError):
            continue  # not ours, or still being created
        if process_alive(int(agent["pid"]), agent.get("start_time")):
            continue
        try:
            with open(os.path.join(path, _WORKERS_FILE)) as f:
                workers = json.load(f)
        except (OSError, ValueError):
            workers = []
        for pid, start in workers:
            if process_alive(int(pid), start):
                logger.warning("killing worker %s left running by a killed kaitianrun agent", pid)
                try:
                    os.killpg(int(pid), signal.SIGKILL)
                except OSError:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
        _collect_namespaces(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
