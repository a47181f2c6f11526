"""A script may end without destroy_process_group(), as with gloo and NCCL (issue 20).

The interpreter then tears the backend down at exit; kaitian's op threads must
be done with Python-owned tensors before it finalizes. Small chunks made the
abort (``terminate called without an active exception``) near certain.
"""

from __future__ import annotations

from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail


def test_script_ending_without_destroy_exits_zero():
    # before the fix: 4096 failed nearly every run, the default chunk about 1 in 3
    for attempt, chunk in enumerate(["4096", "4096", "1048576"]):
        layout = Layout("1+1", env=(("KAITIAN_CHUNK_BYTES", chunk),))
        run = run_ranks(layout, [worker("no_destroy")], timeout=60)
        try:
            logs = [tail(log) for log in run.logs]
            assert run.returncodes == [0, 0], f"attempt {attempt}: {run.returncodes}\n" + "\n".join(logs)
            assert not any("terminate called" in log for log in logs), logs
            assert run.leftover_shm == []
        finally:
            cleanup(run)
