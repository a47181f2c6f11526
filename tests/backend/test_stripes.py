"""Stripe weights (kaitian.backend.stripes): exact under any weights, and ranks
that disagree on them fail loudly instead of reducing different stripes.

Layout 2+1 (every CPU rank reduces a stripe across groups), a 4 KiB chunk so
that 100k elements cross many rounds; both bridges. About 10 s per run.
"""

from __future__ import annotations

import json
import os

import pytest

from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail

BRIDGES = pytest.mark.parametrize("bridge", ["shm", "tcp"])


def _run(case: str, bridge: str) -> list:
    layout = Layout("2+1", env=(("KT_CASE", case), ("KAITIAN_BRIDGE", bridge), ("KAITIAN_CHUNK_BYTES", "4096")))
    run = run_ranks(layout, [worker("stripes")], timeout=120)
    try:
        results = []
        for rank, out in enumerate(run.outs):
            if not os.path.exists(out):
                pytest.fail(f"rank {rank} wrote no result, exit {run.returncodes[rank]}:\n{tail(run.logs[rank])}")
            with open(out) as f:
                results.append(json.load(f))
        assert run.returncodes == [0, 0, 0], "\n".join(tail(p) for p in run.logs)
    finally:
        cleanup(run)
    return results


@BRIDGES
def test_all_reduce_is_exact_under_any_stripe_weights(bridge: str) -> None:
    results = _run("exact", bridge)
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], (rank, r["mismatches"])
        # the weights are what each rank reduced: a rank weighted 0 reduces nothing
        assert r["reduced"]["[3, 1, 0]"] > 0 if rank < 2 else r["reduced"]["[3, 1, 0]"] == 0, (rank, r["reduced"])
        assert (r["reduced"]["[0, 0, 1]"] == 0) == (rank < 2), (rank, r["reduced"])
        assert r["reduced"]["[3, 1, 0]"] > 2 * results[1]["reduced"]["[3, 1, 0]"] or rank != 0, r["reduced"]
        bad = r["bad"]
        assert bad[0].startswith("ValueError") and "2 weights for 3 ranks" in bad[0], bad
        assert bad[1].startswith("ValueError") and "-1" in bad[1], bad
        assert bad[2].startswith("ValueError") and "every weight is 0" in bad[2], bad
        assert bad[3].startswith("ValueError") and "integers" in bad[3], bad
        assert r["after_bad"] == [3.0] * 5, r
        assert r["after_balance_ok"], r
    # balance_stripes: every rank set the same weights
    assert results[0]["balanced"] == results[1]["balanced"] == results[2]["balanced"], results
    assert results[0]["balanced"] and len(results[0]["balanced"]) == 3, results[0]


@BRIDGES
def test_ranks_that_disagree_on_stripe_weights_fail_on_every_rank(bridge: str) -> None:
    for rank, r in enumerate(_run("disagree", bridge)):
        assert r["error"] and "stripe weights" in r["error"], (rank, r)
        assert r["seconds"] < 10, (rank, r)
        assert r["after"], (rank, r)  # the group is broken: the next collective raises too
