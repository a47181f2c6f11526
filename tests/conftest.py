"""Shared pytest set-up: ``tests/`` is on ``sys.path`` (``pythonpath`` in
pyproject.toml), so tests import their helpers as ``support.*``.

``make test`` runs the suite in two passes (scripts/test.sh): the ``serial``
tests one after the other in the foreground, the rest on pytest workers
beside them, in the background (only the CPU the serial pass leaves idle).
Serial are the tests whose assertions need the machine: deadlines of a second
or two, a CPU quota measured against a whole core, a split that equal speeds
must make equal. A file of such tests is named here; a file that mixes them
with others marks them (``@pytest.mark.serial``), so that the rest, which only
needs time, runs in the background.
"""

import pytest

SERIAL_FILES = {
    "backend/test_abort.py",  # abort within a deadline
    "backend/test_backend_runtime.py",  # timeouts measured to a fraction of a second
    "backend/test_collective_failures.py",  # wait(timeout=1 s) returns within 5 s
    "backend/test_diagnostics.py",  # a hung rank named within 10 s
    "backend/test_faults.py",  # a peer's death noticed within 1 s
    "training/test_rebalance_online.py",  # equal speeds give an equal split
    "training/test_ddp_weighting.py",  # re-balances between CPU-quota groups
    "training/test_capability.py",  # measured capabilities
    "training/test_demo.py",  # a third of a core against a whole one
    "docker/test_docker_runtime.py",  # container CPU quotas, stop deadlines
    "elastic/test_elastic.py",  # the quorum's deadlines, SIGSTOP
    "elastic/test_elastic_cluster.py",  # a lost host decided after the quorum deadline
    "elastic/test_elastic_docker.py",  # the same, in containers
    "monitor/test_monitor.py",  # step timings
    "testing/test_device_path.py",  # per-phase watchdogs, the step clock
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    tests = config.rootpath / "tests"
    for item in items:
        if item.path.relative_to(tests).as_posix() in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)


def pytest_configure(config):
    stale = sorted(f for f in SERIAL_FILES if not (config.rootpath / "tests" / f).is_file())
    if stale:
        raise pytest.UsageError(f"tests/conftest.py: SERIAL_FILES names missing files: {', '.join(stale)}")
    config.addinivalue_line("markers", "serial: needs the machine: runs in the foreground (tests/conftest.py)")
