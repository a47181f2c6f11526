"""One rank of the failure scenarios: a peer dies, or a wait times out.

Scenarios (``--scenario``):

* ``kill-RANK``: after one good all_reduce, rank RANK kills itself with
  SIGKILL; every survivor then calls all_reduce and must get an error (not a
  hang) within the group's timeout.
* ``none``: one all_reduce and a clean exit.
* ``wait-timeout``: the last rank joins an all_reduce 8 s late; rank 0's
  ``work.wait(timeout=1s)`` must raise within a few seconds.

Each survivor writes one JSON line: how long the failing call took and the
error text.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from support.worker_env import rank_env

__all__ = ["main"]

PG_TIMEOUT = 10.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    args = ap.parse_args(argv)
    import kaitian  # noqa: F401

    me = rank_env()
    dist.init_process_group("kaitian", timeout=timedelta(seconds=PG_TIMEOUT))
    t = torch.ones(1000)
    dist.all_reduce(t)
    ok_first = bool((t == me.world_size).all())
    rec = {"rank": me.rank, "first_ok": ok_first}
    if args.scenario.startswith("kill-"):
        victim = int(args.scenario.split("-")[1])
        dist.barrier()
        if me.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        start = time.monotonic()
        try:
            for _ in range(3):  # the first call may complete before the death is seen
                dist.all_reduce(torch.ones(1 << 16))
            rec.update(raised=False, msg="three all_reduce calls succeeded with a dead peer")
        except Exception as e:  # the error we want
            rec.update(raised=True, msg=f"{type(e).__name__}: {e}"[:2000])
        rec["seconds"] = time.monotonic() - start
    elif args.scenario == "wait-timeout":
        if me.rank == me.world_size - 1:
            time.sleep(8)
            dist.all_reduce(torch.ones(10))
        else:
            work = dist.all_reduce(torch.ones(10), async_op=True)
            start = time.monotonic()
            try:
                work.wait(timedelta(seconds=1))
                rec.update(raised=False, msg="wait(1s) returned although a peer was 8 s late")
            except Exception as e:
                rec.update(raised=True, msg=f"{type(e).__name__}: {e}"[:2000])
            rec["seconds"] = time.monotonic() - start
    with open(me.out, "w") as fh:
        fh.write(json.dumps(rec) + "\n")
    if args.scenario == "none":  # a clean job: normal teardown
        dist.destroy_process_group()
        return 0
    # A group with a dead peer cannot be torn down collectively: leave at once.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
