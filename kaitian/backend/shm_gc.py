"""Collects shared-memory segments left behind by killed kaitian processes.

A segment is named ``/kaitian-<pidns>-<pid>-<token>-r<rank>-<random>``: the
creator's pid namespace and pid, the group instance's token, and 64 random bits
so that no other local user can guess (and pre-create or open) it. It normally
lives only while a process group is being built (it is unlinked once every peer
has mapped it), so one that outlives its creator is garbage. Segments from
another pid namespace (another container) cannot be checked for liveness and are
collected only when older than the group timeout (a slow peer may still be about
to open a younger one) and at least ten minutes.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from typing import Iterator, List, Tuple

__all__ = ["SHM_DIR", "segment_name", "pid_namespace", "collect_stale_segments", "collect_namespace_segments"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^kaitian-(\d+)-(\d+)-[0-9a-f]+-r\d+(?:-[0-9a-f]+)?$")
# Least age at which a segment from a foreign pid namespace counts as abandoned.
_FOREIGN_MAX_AGE_S = 600.0
# torch's default process group timeout: the age floor when the caller gives none.
_DEFAULT_GROUP_TIMEOUT_S = 1800.0


def pid_namespace(pid: object = "self") -> int:
    """The inode of a process's pid namespace, this process's by default (0 if unknown)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(token: str, rank: int) -> str:
    """The POSIX shm name of this process's bridge segment for one group instance.

    Unguessable (64 random bits) and fresh on every call; peers learn it through
    the owner-only store in the run directory.
    """
    return f"/kaitian-{pid_namespace()}-{os.getpid()}-{token}-r{rank}-{secrets.token_hex(8)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _segments(shm_dir: str) -> Iterator[Tuple[str, int, int]]:
    """``(name, pid namespace, pid)`` of every kaitian segment in ``shm_dir``."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return
    for name in names:
        match = _NAME.match(name)
        if match:
            yield name, int(match.group(1)), int(match.group(2))


def _unlink(shm_dir: str, name: str) -> bool:
    try:
        os.unlink(os.path.join(shm_dir, name))
        return True
    except OSError:
        return False


def collect_stale_segments(shm_dir: str = SHM_DIR, min_age_s: float = _DEFAULT_GROUP_TIMEOUT_S) -> List[str]:
    """Unlinks kaitian segments whose creating process is gone.

    A segment whose creator is in our pid namespace goes as soon as that process
    is dead (nobody can use it any more). One from another namespace goes only
    when older than ``min_age_s`` and ten minutes: a peer of its group may still
    be about to open it until the group's timeout has passed.

    Args:
        shm_dir: where POSIX shared memory lives (``/dev/shm`` on Linux).
        min_age_s: the process group timeout in seconds.

    Returns:
        The names that were removed.
    """
    removed: List[str] = []
    my_ns = pid_namespace()
    now = time.time()
    min_age = max(float(min_age_s), _FOREIGN_MAX_AGE_S)
    for name, ns, pid in _segments(shm_dir):
        if ns == my_ns:
            stale = not _pid_alive(pid)
        else:
            try:
                st = os.stat(os.path.join(shm_dir, name))
            except OSError:
                continue
            stale = now - st.st_mtime > min_age  # sizing and writes move mtime forward
        if stale and _unlink(shm_dir, name):
            removed.append(name)
            logger.info("kaitian: removed stale shared memory %s (pid %s is gone)", name, pid)
    return removed


def collect_namespace_segments(pid_ns: int, shm_dir: str = SHM_DIR) -> List[str]:
    """Unlinks every kaitian segment created in pid namespace ``pid_ns``.

    For callers that know a namespace is gone for good (the docker runtime,
    after removing a container), so its segments need not wait to age out.

    Returns:
        The names that were removed.
    """
    return [name for name, ns, _ in _segments(shm_dir) if ns == pid_ns and _unlink(shm_dir, name)]
