"""Segment names are unguessable; clean-up never takes a segment a slow peer may still open."""

from __future__ import annotations

import os
import time

from kaitian.backend import shm_gc


def _touch(name: str, age: float = 0.0) -> str:
    path = os.path.join(shm_gc.SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_segment_names_are_fresh_random_and_collectable() -> None:
    a, b = shm_gc.segment_name("abc123", 0), shm_gc.segment_name("abc123", 0)
    assert a != b, "two groups' names must differ even with the same token"
    prefix = f"/kaitian-{shm_gc.pid_namespace()}-{os.getpid()}-abc123-r0-"
    assert a.startswith(prefix) and len(a) - len(prefix) == 16, a
    assert shm_gc._NAME.match(a[1:]), a


def test_foreign_segment_younger_than_the_group_timeout_is_kept() -> None:
    ns = shm_gc.pid_namespace() + 1  # another container
    young = _touch(f"kaitian-{ns}-{os.getpid()}-abc123-r0-{'0' * 16}", age=900)
    old = _touch(f"kaitian-{ns}-{os.getpid()}-abc123-r1-{'1' * 16}", age=4000)
    try:
        # a 1-hour group timeout: a 15-minute-old segment may still be opened
        removed = shm_gc.collect_stale_segments(min_age_s=3600)
        assert os.path.exists(young) and os.path.basename(old) in removed
        # a short timeout never lowers the floor below ten minutes
        assert os.path.basename(young) in shm_gc.collect_stale_segments(min_age_s=1)
    finally:
        for p in (young, old):
            if os.path.exists(p):
                os.unlink(p)
