"""A benchmark's bad flags: one line and exit 2 before anything starts. Each of these ran a job
that failed with a traceback (a median of nothing, a job too short to kill in, one group for two)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("bench, args, fragment", [
    ("launch", ["--repeats", "0"], "need --repeats >= 1"),
    ("launch", ["--nproc", "0"], "--nproc >= 1"),
    ("recovery", ["--nproc", "1"], "--nproc 1: two simulated vendor groups need at least 2 workers"),
    ("recovery", ["--epochs", "0"], "--epochs"),
    ("recovery", ["--kill-at", "999"], "--kill-at 999: the job has 80 steps"),  # 2 epochs of 7680 / (64 x 3)
    ("recovery", ["--modes", "bogus"], "unknown mode(s) bogus"),
    ("docker", ["--nproc", "0"], "need --nproc, --size-mb, --iters and --runs >= 1"),
    ("docker", ["--groups", "3"], "--groups must be between 1 and --nproc (2)"),
    ("collectives", ["--groups", "3"], "--groups must be between 1 and --nproc (2)"),
], ids=["launch-repeats", "launch-nproc", "recovery-nproc", "recovery-epochs", "recovery-kill-at", "recovery-modes",
        "docker-nproc", "docker-groups", "collectives-groups"])
def test_a_bad_flag_is_one_line_and_exit_2(capsys, bench, args, fragment):
    main = importlib.import_module(f"kaitian.bench.{bench}").main
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"kaitian bench {bench}: ") and fragment in err[0], err
