"""``kaitian bench collectives``: the formulas, the argument errors, and one real small run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kaitian.bench.collectives import bus_bandwidth, parse_size

from support import REPO


def _kaitian(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "kaitian", "bench", "collectives", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


def test_bus_bandwidth_follows_nccl_tests() -> None:
    # nccl-tests PERFORMANCE.md: allreduce 2(n-1)/n, allgather/reduce_scatter/alltoall (n-1)/n, broadcast/reduce 1.
    assert bus_bandwidth("allreduce", 10**9, 1.0, 2) == pytest.approx(1.0)
    assert bus_bandwidth("allreduce", 10**9, 1.0, 4) == pytest.approx(1.5)
    assert bus_bandwidth("allgather", 10**9, 0.5, 4) == pytest.approx(1.5)
    assert bus_bandwidth("reduce_scatter", 10**9, 1.0, 2) == pytest.approx(0.5)
    assert bus_bandwidth("alltoall", 10**9, 1.0, 3) == pytest.approx(2 / 3)
    assert bus_bandwidth("broadcast", 2 * 10**9, 1.0, 8) == pytest.approx(2.0)
    assert bus_bandwidth("reduce", 10**9, 2.0, 8) == pytest.approx(0.5)


def test_parse_size() -> None:
    assert parse_size("4K") == 4096
    assert parse_size("64M") == 64 << 20
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("100") == 100
    with pytest.raises(ValueError):
        parse_size("lots")


@pytest.mark.parametrize("args,fragment", [
    (("--ops", "allreduce,frobnicate"), "unknown op frobnicate"),
    (("--sizes", "4K,huge"), "not a size"),
    (("--nproc", "1"), "--nproc must be at least 2"),
    (("--groups", "3"), "--groups must be between 1 and --nproc"),
    (("--cpu-quota", "-1"), "--cpu-quota '-1': give cores of CPU time per CPU group"),
    (("--groups", "2", "--cpu-quota", "1"), "--cpu-quota has 1 values for 2 groups"),
])
def test_bad_arguments_give_one_line(args, fragment) -> None:
    proc = _kaitian(*args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_small_run_prints_both_backends_and_targets() -> None:
    proc = _kaitian("--ops", "allreduce,broadcast", "--sizes", "4K,64K", "--iters", "5", "--ddp-steps", "2",
                    "--ddp-width", "64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("allreduce ", "broadcast "))]
    assert len(rows) == 4, proc.stdout
    for row in rows:  # op, size, unit, kt us, kt GB/s, gloo us, gloo GB/s, lat ratio, bw ratio
        kt_us, gloo_us = float(row[3]), float(row[5])
        assert kt_us > 0 and gloo_us > 0
        assert float(row[7]) == pytest.approx(kt_us / gloo_us, rel=0.02, abs=0.002)
    assert "DDP step" in proc.stdout and "allreduce 4 KiB latency <= 0.2x gloo" in proc.stdout, proc.stdout


def test_cpu_quota_gives_each_group_its_cores() -> None:
    """docs/backend.md's ``--cpu-quota 1,0.1 --stripes weighted``: any --cpu-quota raised an ImportError
    (a module renamed under it) from 2026-12-05 to 12-07."""
    proc = _kaitian("--groups", "2", "--cpu-quota", "1,0.5", "--stripes", "weighted", "--ops", "allreduce",
                    "--sizes", "64K", "--iters", "3", "--ddp-steps", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "groups ['cpu0', 'cpu1'] at 1, 0.5 cores of CPU time" in proc.stdout, proc.stdout
    assert "stripe weights from measured reduce speeds" in proc.stdout and "  weighted " in proc.stdout, proc.stdout


def test_memory_line_shows_per_rank_shared_memory_independent_of_world_size() -> None:
    proc = _kaitian("--memory", "2,4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {int(line.split()[0]): [float(x) for x in line.split()[1:]]
            for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()}
    assert sorted(rows) == [2, 4], proc.stdout
    # per rank: O(chunk) (8 chunk slots of 1 MiB + a chunk of mailboxes), not a mailbox per peer
    for world, (per_group, per_rank, per_process, mapped, _delta) in rows.items():
        assert 8 <= per_rank <= 9.5, proc.stdout
        assert per_group == pytest.approx(per_rank * world, rel=0.01), proc.stdout
    assert rows[4][1] <= rows[2][1], proc.stdout
