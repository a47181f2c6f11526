"""Worker: abort / destroy a process group while a collective is stuck.

torchrun-style (environment from support.ranks.run_ranks; legacy argv flags are
ignored). Rank ``--missing`` never joins the collective: it waits (at most
``--missing-sleep`` seconds) until every other rank has exited, records how
long after their stop call each one did, then leaves. Every other rank blocks in
``all_reduce`` (group timeout 60 s) while a second thread, after one second,
calls ``--how``: ``abort`` (``_abort_process_group``, what torch's abort path
runs) or ``destroy`` (``destroy_process_group``). The rank then records how
long that call took, how long until the blocked collective raised, and what a
later op on the same group says. One JSON line goes to ``KT_OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_for_the_others(rank: int, world: int, limit: float) -> None:
    """Stays alive (the peer that never comes) until the other ranks exited."""
    out = os.environ["KT_OUT"]
    paths = {r: out.replace(f"rank{rank}.jsonl", f"rank{r}.jsonl") for r in range(world) if r != rank}
    exit_after_stop = {}
    deadline = time.monotonic() + limit
    while len(exit_after_stop) < len(paths) and time.monotonic() < deadline:
        for r, path in paths.items():
            if r in exit_after_stop or not os.path.exists(path):
                continue
            with open(path) as fh:
                line = fh.readline()
            if not line.endswith("\n"):
                continue
            rec = json.loads(line)
            if _exited(rec["pid"]):
                exit_after_stop[r] = time.time() - rec["stop_wall"]
        time.sleep(0.05)
    with open(out, "a") as fh:
        fh.write(json.dumps({"rank": rank, "exit_after_stop_s": exit_after_stop}) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--how", choices=("abort", "destroy"), default="abort")
    ap.add_argument("--missing", type=int, default=1)
    ap.add_argument("--missing-sleep", type=float, default=30.0)
    args, _ = ap.parse_known_args(argv)
    import kaitian  # noqa: F401  registers the backend

    dist.init_process_group("kaitian", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if rank == args.missing:
        _wait_for_the_others(rank, dist.get_world_size(), args.missing_sleep)
        dist.destroy_process_group()
        return 0
    pg = dist.group.WORLD
    stopped = {}

    def stopper() -> None:
        time.sleep(1.0)
        stopped["at"] = time.monotonic()
        stopped["wall"] = time.time()
        if args.how == "abort":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
        stopped["call_s"] = time.monotonic() - stopped["at"]

    thread = threading.Thread(target=stopper, daemon=True)
    thread.start()
    error = None
    try:
        dist.all_reduce(torch.ones(4096))
    except Exception as exc:  # the point: it must raise, soon
        error = f"{type(exc).__name__}: {exc}"
    raised = time.monotonic()
    thread.join(timeout=30)
    later = None
    try:
        pg.allreduce([torch.ones(4)]).wait()
    except Exception as exc:
        later = f"{type(exc).__name__}: {exc}"
    rec = {"rank": rank, "error": error, "call_s": stopped.get("call_s"),
           "raised_after_s": raised - stopped["at"] if "at" in stopped else None,
           "stopper_alive": thread.is_alive(), "later": later, "pid": os.getpid(),
           "stop_wall": stopped.get("wall")}
    with open(os.environ["KT_OUT"], "a") as out:
        out.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
