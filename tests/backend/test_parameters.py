"""Collectives on ``nn.Parameter`` (issue 9, "Parameters fail").

``dist.broadcast(p, 0)`` / ``dist.all_reduce(p)`` of a contiguous,
non-contiguous or channels_last Parameter, sync and async, must give gloo's
values and leave a usable leaf Parameter (the progress threads write into it
outside autograd, as gloo does).
"""

from __future__ import annotations

import json
import os

import pytest

from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail

WORKER = worker("parameters")
CASES = [f"{op}-{layout}{suffix}" for layout in ("contiguous", "noncontig", "channels_last")
         for op in ("broadcast", "all_reduce") for suffix in ("", "-async")]


@pytest.fixture(scope="module", params=["1+1", "2+1"])
def results(request):
    layout = Layout(request.param)
    run = run_ranks(layout, [WORKER], timeout=120)
    recs = []
    for path in run.outs:
        per = {}
        if os.path.exists(path):
            with open(path) as fh:
                for line in fh:
                    rec = json.loads(line)
                    per[rec["case"]] = rec
        recs.append(per)
    logs = [tail(p) for p in run.logs]
    info = (layout, run.returncodes, run.timed_out, logs)
    cleanup(run)
    return recs, info


@pytest.mark.parametrize("case", CASES)
def test_parameter_collective_matches_gloo(results, case):
    recs, (layout, codes, timed_out, logs) = results
    for rank, per in enumerate(recs):
        rec = per.get(case)
        assert rec is not None, f"[{layout.spec}] rank {rank} gave no result for {case}; codes {codes}, " \
                                f"timed out {timed_out}\n" + logs[rank]
        assert rec["ok"], f"[{layout.spec}] rank {rank} {case}: {rec['msg']}\n{rec.get('trace', '')}"


def test_ranks_exit_cleanly(results):
    _, (layout, codes, timed_out, logs) = results
    assert not timed_out and codes == [0] * layout.world_size, "\n".join(logs)
