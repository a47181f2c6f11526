"""Exact global-batch gradients (fp64, 1e-9 against one process on the union) in every case.

Two ranks in two simulated vendor groups, backend kaitian. Each case runs
``kaitian.DistributedDataParallel`` and torch's own DDP with
``kaitian.scale_loss``; torch's DDP alone is the control that must be off.
"""

import json

import pytest

from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail

CASES = ["unequal", "coupled", "eval_forward", "no_sync", "builtin_hook", "python_hook", "tokens", "join", "two_views"]


@pytest.fixture(scope="module")
def results():
    run = run_ranks(Layout("1+1"), [worker("weighting_cases")], timeout=180)
    try:
        assert run.returncodes == [0, 0] and not run.timed_out, tail(run.logs[0]) + tail(run.logs[1])
        assert not run.leftover_shm
        per_rank = []
        for out in run.outs:
            with open(out) as f:
                per_rank.append({(r["case"], r["mode"]): r for r in map(json.loads, f)})
        yield per_rank
    finally:
        cleanup(run)


@pytest.mark.parametrize("mode", ["kaitian", "torch"])
@pytest.mark.parametrize("case", [c for c in CASES if c != "join"])
def test_exact_against_one_process(results, case, mode):
    for rank in results:
        r = rank[(case, mode)]
        assert r["worst"] < 1e-9, r
        assert r["steps"] >= 2


@pytest.mark.parametrize("case", ["unequal", "no_sync", "two_views"])
def test_step_timings_count_the_batches_samples(results, case):
    """A step's timing counts the samples of the batches it trained: every micro-batch of a window, but the
    two views of a batch once (the re-balancer fits its step cost to them, the monitor shows them)."""
    from workers.weighting_cases import SIZES

    for rank, r in enumerate(results):
        timed = r[(case, "kaitian")]["timed"]
        assert timed == [[sum(step[rank]), sum(map(sum, step))] for step in SIZES[case]], timed


@pytest.mark.parametrize("case", ["unequal", "coupled", "no_sync"])
def test_gradients_in_the_buckets_by_default_and_exact_either_way(results, case):
    """kaitian's DDP keeps gradients in the buckets unless told otherwise; both are exact."""
    for rank in results:
        assert rank[(case, "kaitian")]["bucket_view"] is True
        assert rank[(case, "torch")]["bucket_view"] is False
        copy = rank[(case, "kaitian-copy")]
        assert copy["bucket_view"] is False and copy["worst"] < 1e-9, copy


@pytest.mark.parametrize("case", ["unequal", "coupled", "no_sync"])
def test_torch_ddp_alone_is_off(results, case):
    """The control: averaging unequal batches without weighting is measurably wrong."""
    assert all(rank[(case, "plain")]["worst"] > 1e-3 for rank in results)


def test_a_world_of_one_skips_the_exchange_and_stays_exact(tmp_path):
    """One rank: kaitian's DDP leaves torch's reducer out (nothing to exchange) unless a hook must
    run, and its gradients stay the window's mean (micro-batches of different sizes, token counts,
    a forward with no backward)."""
    cases = ["unequal", "no_sync", "tokens", "eval_forward", "builtin_hook", "two_views"]
    run = run_ranks(Layout("1"), [worker("weighting_cases"), "--cases", ",".join(cases)], timeout=120)
    try:
        assert run.returncodes == [0] and not run.timed_out, tail(run.logs[0])
        with open(run.outs[0]) as f:
            got = {(r["case"], r["mode"]): r for r in map(json.loads, f)}
    finally:
        cleanup(run)
    for case in cases:
        for mode in ("kaitian", "torch"):
            assert got[(case, mode)]["worst"] < 1e-9, (case, mode, got[(case, mode)])
        assert got[(case, "kaitian")]["alone"] is (case != "builtin_hook"), got[(case, "kaitian")]
    assert got[("no_sync", "plain")]["worst"] > 1e-3  # unequal micro-batches: the control is off


def test_join(results):
    """kaitian's DDP refuses join() clearly; torch's join with scale_loss(total=) stays exact."""
    for rank in results:
        assert rank[("join", "kaitian")]["refused"].startswith(
            "kaitian.DistributedDataParallel does not support join()")
        assert rank[("join", "torch")]["worst"] < 1e-9


def test_ranks_at_different_steps_a_wrong_loader_and_a_late_forward_are_named_and_batchnorm_gets_two():
    run = run_ranks(Layout("1+1"), [worker("weighting_cases"), "--cases", "hardening"], timeout=120)
    try:
        assert run.returncodes == [0, 0] and not run.timed_out, tail(run.logs[0]) + tail(run.logs[1])
        for out in run.outs:
            with open(out) as f:
                r = json.loads(f.read())
            assert r["positional"].startswith("DistributedSampler(dataset, 64): the second argument is "
                                              "num_replicas"), r["positional"]
            assert r["min_batch"] == 2  # kaitian's DDP saw the BatchNorm
            assert min(r["sizes"]) >= 2  # the short last step too (3+2 of 5, not 4+1)
            for mode in ("torch", "kaitian"):
                assert r[mode].startswith("ranks are at different steps (rank 0 at epoch 0 step 2, "
                                          "rank 1 at epoch 1 step 0)"), r[mode]
                assert "batch_sampler=sampler.batch_sampler()" in r[mode]
                # refused at the first step, on every rank
                assert r[f"loader {mode} steps"] == 0
                assert r[f"loader {mode}"].startswith(
                    "rank 0's DataLoader has taken 8 samples, not whole steps of 14 (kaitian's split [14, 2]): "
                    "a DataLoader's batch_size must be its rank's share"), r[f"loader {mode}"]
                assert "batch_sampler=sampler.batch_sampler()" in r[f"loader {mode}"]
            assert r["late forward"].startswith("kaitian.DistributedDataParallel: a forward's outputs got their "
                                                "gradient after the first gradient bucket was ready"), r
    finally:
        cleanup(run)
