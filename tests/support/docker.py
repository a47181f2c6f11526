"""Shared by the docker tests: a running engine (or a clear failure) and the
locally built CPU test image. CI starts the engine through scripts/docker-engine.sh
(`make test`); a missing engine fails these tests, it never skips them."""

from __future__ import annotations

import functools
import io

import pytest

__all__ = ["TEST_IMAGE", "engine", "test_image", "kaitian_containers"]

TEST_IMAGE = "kaitian-test:cpu-host"


@functools.lru_cache(maxsize=None)
def _client():
    from kaitian.launcher.runtimes.docker.runtime import DockerUnavailableError, connect

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
    from kaitian.launcher.runtimes.docker.images import build

    build("cpu-host", tag=TEST_IMAGE, out=io.StringIO(), client=engine())
    return TEST_IMAGE


def test_image() -> str:
    """Builds (once per session) the host-Python CPU image the tests run in."""
    engine()
    return _build()


test_image.__test__ = False  # not a test, despite its name


def kaitian_containers(**labels):
    """kaitian-managed containers (all states) carrying ``labels`` (short names)."""
    filters = ["org.kaitian.managed=1"] + [f"org.kaitian.{k.replace('_', '-')}={v}" for k, v in labels.items()]
    return engine().containers.list(all=True, filters={"label": filters})
