"""Shared by the docker tests: a running engine (or a clear failure), the locally
built CPU test image, and a working directory owned by the workers' user.

CI starts the engine through scripts/docker-engine.sh (`make test`); a missing
engine fails these tests, it never skips them.

Workers run as the agent, except that a root agent (CI) in a user's directory
runs them as its owner: most tests hand their directories to ``WORKER_UID``
(``own``) to prove that path; a non-root agent runs them as itself, and
``own`` does nothing.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import subprocess
import sys

import pytest

__all__ = ["TEST_IMAGE", "WORKER_UID", "engine", "test_image", "kaitian_containers", "own", "inspect", "run_agent"]

# The image mounts the Python environment the tests run from: one tag per
# environment, so that test sessions from two environments at once (CI runs the
# system Python's beside the main venv's) never run in each other's image.
TEST_IMAGE = f"kaitian-test:cpu-host-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]}"
# The unprivileged owner of the tests' working directories when they run as root.
WORKER_UID = 4321 if os.getuid() == 0 else os.getuid()


@functools.lru_cache(maxsize=None)
def _client():
    from kaitian.errors import DockerUnavailableError
    from kaitian.launcher.runtimes.docker.runtime import connect

    try:
        return connect()
    except DockerUnavailableError as exc:
        return exc


def engine():
    """The docker SDK client, or a test failure saying how to start the engine."""
    client = _client()
    if isinstance(client, Exception):
        pytest.fail(f"the docker tests need a running Docker engine ({client}); "
                    "run `bash scripts/docker-engine.sh` (make test does)", pytrace=False)
    return client


@functools.lru_cache(maxsize=None)
def _build() -> str:
    from kaitian.images import build

    build("cpu-host", tag=TEST_IMAGE, out=io.StringIO(), client=engine())
    return TEST_IMAGE


def test_image() -> str:
    """Builds (once per session) the host-Python CPU image the tests run in."""
    engine()
    return _build()


test_image.__test__ = False  # not a test, despite its name


def own(path):
    """Makes ``path`` (a directory, created if missing) the workers': owned by
    ``WORKER_UID`` when the tests run as root. Returns ``path``."""
    os.makedirs(path, exist_ok=True)
    if os.getuid() == 0:
        os.chown(path, WORKER_UID, WORKER_UID)
    return path


def kaitian_containers(**labels):
    """kaitian-managed containers (all states) carrying ``labels`` (short names)."""
    from kaitian.launcher.runtimes.docker.runtime import list_containers

    wanted = {"org.kaitian.managed": "1", **{f"org.kaitian.{k.replace('_', '-')}": str(v) for k, v in labels.items()}}
    return list_containers(engine(), wanted)


def inspect(container) -> dict:
    """``docker inspect`` of a container (fresh)."""
    return engine().api.inspect_container(container.id)


def run_agent(argv, timeout, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` (output captured, text) of an agent that keeps its pid
    (``.pid``): its containers carry it, so a test checks only its own while
    other tests' containers come and go."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
    done = subprocess.CompletedProcess(argv, p.returncode, out, err)
    done.pid = p.pid
    return done
