"""One rank of a fail-stop scenario (tests/backend/test_faults.py).

torchrun-style: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
environment, ``dist.init_process_group("kaitian")``, one JSON line per op to the
file in ``KT_OUT``: ``{"rank", "step", "ok", "value", "error", "seconds"}``.

Scenarios (``--scenario``):

* ``late``: the last rank starts its ops 2 x the timeout late. Every other rank's
  first all_reduce must time out, its second (input 10) must raise at once
  naming the first failure; the late rank must not get a value mixed from
  different rounds. Then every rank builds a new kaitian group, which works.
* ``mismatch-KIND``: rank 0 and the others issue different collectives (KIND =
  op, size, dtype, root, split, pair-split, redop); every rank must raise, then a second
  all_reduce must raise too.
* ``anysource-dead``: the last rank exits after a barrier; rank 0's recv from
  any source must fail well before the timeout.
* ``anysource-sleep``: the last rank sends after 2 s; rank 0's recv from any
  source gets it and records its context switches while it waited.
* ``p2p-size``: rank 1 sends 8 floats, rank 0 receives 4: rank 0's recv
  raises, and the next all_reduce raises on both ranks.
* ``propagate``: three ranks; ranks 0 and 2 call all_reduce with a 2 s op
  timeout while rank 1 waits in recv from rank 0 (a user bug): rank 1 never
  sees the timeout itself but must raise with it well before its own 30 s.
* ``foreign-dead``: the last rank runs in its own pid namespace (re-executed
  under ``unshare``), so its pid means nothing to rank 0; it exits after a
  barrier and rank 0's all_reduce must fail through the heartbeat.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

__all__ = ["main"]


def _switches() -> int:
    """Context switches of every thread of this process so far."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as fh:
                total += sum(int(line.split()[-1]) for line in fh if "ctxt_switches" in line)
        except OSError:
            pass
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--timeout", type=float, default=5.0)
    args, _ = ap.parse_known_args(argv)
    if args.scenario == "foreign-dead" and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1 \
            and not os.environ.get("KT_UNSHARED"):
        os.environ["KT_UNSHARED"] = "1"
        os.execvp("unshare", ["unshare", "--pid", "--fork", sys.executable, *sys.argv])

    import torch
    import torch.distributed as dist

    import kaitian  # noqa: F401  (registers the backend)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    last = world - 1
    out = open(os.environ["KT_OUT"], "w")

    def record(step: str, fn) -> bool:
        start = time.monotonic()
        rec = {"rank": rank, "step": step}
        try:
            value = fn()
            rec.update(ok=True, value=value, error="")
        except Exception as e:  # the errors the test asserts on
            rec.update(ok=False, value=None, error=f"{type(e).__name__}: {e}"[:3000])
        rec["seconds"] = time.monotonic() - start
        out.write(json.dumps(rec) + "\n")
        out.flush()
        return rec["ok"]

    def all_reduce(value: float, n: int = 8, group=None):
        t = torch.full((n,), float(value))
        dist.all_reduce(t, group=group)
        return t.tolist()

    dist.init_process_group("kaitian", timeout=timedelta(seconds=args.timeout))
    s = args.scenario
    if s == "late":
        if rank == last:
            time.sleep(2 * args.timeout)
        record("first", lambda: all_reduce(1))
        record("second", lambda: all_reduce(10))
        group = dist.new_group(backend="kaitian", timeout=timedelta(seconds=60))
        record("new_group", lambda: all_reduce(rank + 1, group=group))
    elif s.startswith("mismatch-"):
        kind = s.split("-", 1)[1]
        first = rank == 0
        t8 = torch.ones(8)

        def call():
            if kind == "op":
                dist.all_reduce(t8) if first else dist.broadcast(t8, 0)
            elif kind == "size":
                dist.all_reduce(t8 if first else torch.ones(16))
            elif kind == "dtype":
                dist.all_reduce(t8 if first else torch.ones(8, dtype=torch.int32))
            elif kind == "root":
                dist.broadcast(t8, 0 if first else 1)
            elif kind == "redop":
                dist.all_reduce(t8, op=dist.ReduceOp.SUM if first else dist.ReduceOp.MAX)
            elif kind == "split":
                # rank 0 sends 1 row to each rank and expects 1; the others send and expect 2
                ins = outs = [1] * world if first else [2] * world
                inp = torch.ones(sum(ins))
                res = torch.empty(sum(outs))
                dist.all_to_all_single(res, inp, outs, ins)
            elif kind == "pair-split":
                # only rank 1 disagrees, with rank 0: it expects 2 rows from rank 0, which sends 1;
                # every other rank's own transfers match
                ins = [1] * world
                outs = [2] + [1] * (world - 1) if rank == 1 else [1] * world
                dist.all_to_all_single(torch.empty(sum(outs)), torch.ones(sum(ins)), outs, ins)
            else:
                raise SystemExit(f"unknown mismatch kind {kind}")
            return t8.tolist()

        record("mismatch", call)
        record("after", lambda: all_reduce(1))
    elif s == "anysource-dead":
        dist.barrier()
        if rank == last:
            out.close()
            os._exit(0)
        if rank == 0:
            record("recv_any", lambda: dist.recv(torch.empty(4)))
    elif s == "anysource-sleep":
        dist.barrier()
        if rank == last:
            time.sleep(2.0)
            dist.send(torch.full((4,), 7.0), 0)
        elif rank == 0:
            buf = torch.empty(4)

            def recv_any():
                before = _switches()
                src = dist.recv(buf)
                return {"src": src, "data": buf.tolist(), "switches": _switches() - before}

            record("recv_any", recv_any)
        dist.barrier()
    elif s == "p2p-size":
        if rank == 1:
            record("p2p", lambda: dist.send(torch.ones(8), 0))
        elif rank == 0:
            record("p2p", lambda: dist.recv(torch.empty(4), src=1))
        record("after", lambda: all_reduce(1))
    elif s == "propagate":
        if rank == 1:
            record("recv", lambda: dist.recv(torch.empty(4), src=0))
        else:
            opts = dist.AllreduceOptions()
            opts.timeout = timedelta(seconds=2)
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
            record("all_reduce", lambda: backend.allreduce([torch.ones(8)], opts).wait())
    elif s == "foreign-dead":
        dist.barrier()
        if rank == last:
            out.close()
            os._exit(0)
        time.sleep(0.3)
        record("after_death", lambda: all_reduce(1, n=1 << 12))
    else:
        raise SystemExit(f"unknown scenario {s}")
    out.close()
    # A broken group cannot be torn down collectively: leave at once.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
