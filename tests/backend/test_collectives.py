"""Every collective x dtype x reduce op of backend kaitian, checked against gloo.

Each layout (ranks per simulated vendor group, e.g. ``2+1``) starts its ranks
once and runs the whole matrix of ``_collective_matrix.py`` in them; every case
becomes its own pytest item here, named ``layout-case``. A failure message names
the op, dtype, layout, rank and the first differing element. Layouts with fake
MLUs (``2mlu+1cpu``) run the device path on the fake accelerator, whose
streams punish a missing wait; the fake's own ``cncl`` backend is checked here
too, against gloo and against the vendor table's CNCL gaps.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest


from kaitian.devices.vendors import CNCL_GAPS
from support import collective_cases as matrix
from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail

LAYOUTS = [
    Layout("1"),  # world size 1
    Layout("2", kaitian_env=False),  # one group, plain torchrun environment
    Layout("1+1"),
    Layout("2+1"),
    Layout("1+3"),
    Layout("1+1+1"),  # three groups
    # The vendor path (gloo inside each group, hierarchical across): what a real
    # vendor's NCCL/CNCL group goes through, so the whole matrix runs on it.
    Layout("2+1", env=(("KAITIAN_INTRA", "gloo"),)),
    Layout("1+3", env=(("KAITIAN_INTRA", "gloo"),), core_only=True),
    Layout("2+1", env=(("KAITIAN_INTRA", "shm"), ("KAITIAN_CHUNK_BYTES", "65536")), core_only=True),
    Layout("2+1", env=(("KAITIAN_BRIDGE", "tcp"),), core_only=True),
    Layout("1+1", env=(("KAITIAN_BRIDGE", "tcp"), ("KAITIAN_CHUNK_BYTES", "4096")), core_only=True),
    # The device path on fake MLUs: a cncl group beside a CPU rank, and one MLU
    # beside two CPU groups; with 64 KiB chunks the large cases cross many
    # chunks and several segments (16 chunks each).
    Layout("2+1", devices=("mlu", "cpu"), env=(("KAITIAN_CHUNK_BYTES", "65536"),)),
    Layout("1+1+1", devices=("mlu", "cpu", "cpu"), env=(("KAITIAN_CHUNK_BYTES", "65536"),), core_only=True),
]

_SCRIPT = worker("collective_matrix")
_TIMEOUT = float(os.environ.get("KT_MATRIX_TIMEOUT", "240"))


def _run_matrix(layout: Layout, backend: str = "kaitian", fault=None, only=(), skip=()) -> dict:
    """Runs the matrix on ``layout``; returns {case: [per-rank record or None]} plus run info."""
    argv = [_SCRIPT, "--backend", backend]
    if layout.core_only:
        argv.append("--core-only")
    if fault:
        argv.append(f"--fault={fault}")
    for o in only:
        argv.append(f"--only={o}")
    for o in skip:
        argv.append(f"--skip={o}")
    run = run_ranks(layout, argv, _TIMEOUT)
    per_case: dict = {}
    started: list = [None] * layout.world_size
    for rank, path in enumerate(run.outs):
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("start"):
                    started[rank] = rec["case"]
                    continue
                per_case.setdefault(rec["case"], [None] * layout.world_size)[rank] = rec
                started[rank] = None
    info = {
        "returncodes": run.returncodes,
        "timed_out": run.timed_out,
        "seconds": run.seconds,
        "stuck_in": started,
        "logs": [tail(p) for p in run.logs],
        "leftover_shm": run.leftover_shm,
    }
    cleanup(run)
    return {"cases": per_case, "info": info}


@functools.lru_cache(maxsize=None)
def _layout_result(layout: Layout) -> dict:
    return _run_matrix(layout)


def _items():
    for layout in LAYOUTS:
        for name in matrix.case_names(layout.world_size, layout.core_only, layout.fake_mlus > 0):
            yield pytest.param(layout, name, id=f"{layout.id}-{name}")


def _explain_missing(layout: Layout, res: dict, name: str) -> str:
    info = res["info"]
    lines = [f"[{layout.id}] case {name}: no result from some ranks; "
             f"return codes {info['returncodes']}, timed out: {info['timed_out']}, "
             f"ranks stuck in: {info['stuck_in']}"]
    for rank, log in enumerate(info["logs"]):
        lines.append(f"--- rank {rank} log tail ---\n{log}")
    return "\n".join(lines)


@pytest.mark.parametrize("layout,name", list(_items()))
def test_collective(layout: Layout, name: str) -> None:
    res = _layout_result(layout)
    recs = res["cases"].get(name)
    if recs is None or any(r is None for r in recs):
        pytest.fail(_explain_missing(layout, res, name))
    failures = [f"rank {rank} (group {layout.groups[rank]}): {r['msg']}" for rank, r in enumerate(recs) if not r["ok"]]
    if failures:
        pytest.fail(f"[{layout.id}] {name}:\n" + "\n".join(failures))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[l.id for l in LAYOUTS])
def test_ranks_exit_cleanly(layout: Layout) -> None:
    """The default group really is kaitian; every rank exits 0; no shared memory is left."""
    res = _layout_result(layout)
    info = res["info"]
    init = res["cases"].get("__init__") or [None]
    assert all(r is not None and r["ok"] for r in init), [r and r["msg"] for r in init]
    assert not info["timed_out"], _explain_missing(layout, res, "(end of run)")
    assert info["returncodes"] == [0] * layout.world_size, _explain_missing(layout, res, "(end of run)")
    assert not info["leftover_shm"], f"[{layout.id}] shared memory left in /dev/shm: {info['leftover_shm']}"


def test_harness_catches_wrong_results() -> None:
    """The harness itself: gloo checked against gloo passes, except where it must not.

    A deliberately corrupted result (``--fault``) must fail its cases and only
    those; gloo's own broken non-contiguous reduce must be caught too.
    """
    layout = Layout("1+1")
    only = ("all_reduce-SUM-", "all_reduce-MAX-int8", "broadcast-bool", "all_gather-bfloat16",
            "reduce_scatter_tensor-SUM-int16", "all_to_all_single-uneven-float16", "send_recv-int64",
            "gather-uint8", "scatter-float64", "all_reduce-BXOR-int32")
    res = _run_matrix(layout, backend="gloo", fault="-SUM-float32", only=only)
    assert res["info"]["returncodes"] == [0, 0], _explain_missing(layout, res, "(self-check)")
    outcome = {name: all(r["ok"] for r in recs) for name, recs in res["cases"].items() if name != "__init__"}
    # gloo has no int16 at all; a zero-element result cannot be corrupted.
    expected_fail = {n for n in outcome if ("-SUM-float32" in n and not n.endswith("-zero"))
                     or n.endswith("noncontig") or "int16" in n}
    assert {n for n, ok in outcome.items() if not ok} == expected_fail, outcome
    assert "all_reduce-SUM-float32-noncontig" in expected_fail and len(outcome) > 15, outcome


# What the fake cncl backend refuses besides the vendor table's gaps, as CNCL
# does: PREMUL_SUM and non-contiguous tensors; and the ops ProcessGroupCNCL has
# that kaitian never asks of a vendor (left to torch's "does not support").
_CNCL_REFUSES = {"PREMUL_SUM", "noncontig"}
_CNCL_LACKS = {"all_reduce_coalesced", "all_gather_coalesced", "all_gather_into_tensor_coalesced",
               "reduce_scatter_tensor_coalesced", "gather", "scatter", "all_to_all"}


def test_fake_cncl_matches_gloo_where_cncl_can() -> None:
    """The fake accelerator's cncl backend, 2 ranks on fake MLUs, the whole matrix:
    each case passes against gloo unless CNCL cannot do it, and then it raises
    (never rounds). What it refuses by dtype and reduce op is exactly the vendor
    table's CNCL_GAPS (bool, which CNCL carries as uint8, passes)."""
    layout = Layout("2", devices=("mlu",))
    # CNCL has no any-source receive: the peer's send would be left waiting.
    res = _run_matrix(layout, backend="cncl", skip=("recv_anysource",))
    assert res["info"]["returncodes"] == [0, 0], _explain_missing(layout, res, "(cncl)")
    wrong = []
    for name, recs in res["cases"].items():
        parts = set(name.split("-"))
        refused = bool(parts & (CNCL_GAPS | _CNCL_REFUSES)) or name.split("-")[0] in _CNCL_LACKS
        for rank, r in enumerate(recs):
            if r is None or r["ok"] == refused:
                wrong.append(f"{name} rank {rank}: {'no result' if r is None else r['msg'] or 'passed'}")
            elif refused and not ("fake cncl" in r["msg"] or "does not support" in r["msg"]):
                wrong.append(f"{name} rank {rank}: failed without refusing: {r['msg']}")
    assert not wrong and len(res["cases"]) > 250, "\n".join(wrong)
