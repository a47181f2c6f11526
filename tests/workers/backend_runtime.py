"""One rank of a backend scenario (run by tests/test_backend_*.py as a subprocess).

Rank, world size and rendezvous come from the torchrun variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); ``KAITIAN_*`` from the test.
Prints one line ``RESULT <json>`` with what the test asserts on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import kaitian  # noqa: F401  (registers the backend)

__all__ = ["main"]


def _backend(group=None):
    pg = group if group is not None else dist.group.WORLD
    return pg._get_backend(torch.device("cpu"))


def _segments():
    """This process's kaitian segments (other jobs may share /dev/shm)."""
    mine = f"-{os.getpid()}-"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("kaitian-") and mine in n)


def _layout(out: dict) -> None:
    """Construction, layout introspection, subgroups, p2p across groups."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b = _backend()
    out.update(
        backend_class=type(b).__name__, bridge=b.bridge_kind(), group_of=b.group_of(),
        group_names=b.group_names(), flat_intra=b.flat_intra(), has_intra=b.has_intra(),
        backend_name=dist.get_backend(),
    )
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    out["allreduce_ok"] = bool(x.eq(world * (world + 1) / 2).all())
    # Sparse COO (DDP's sparse embedding gradients): SUM of every rank's entries.
    sp = torch.sparse_coo_tensor([[rank, world]], [1.0, 2.0], (world + 1,))
    dist.all_reduce(sp)
    out["sparse_sum"] = sp.to_dense().tolist()
    # Two overlapping kaitian subgroups alive at once (own stores, own shm names).
    sub_a = dist.new_group([0, world - 1], backend="kaitian")
    sub_b = dist.new_group(list(range(1, world)), backend="kaitian")
    if rank in (0, world - 1):
        y = torch.full((300,), float(rank))
        dist.all_reduce(y, group=sub_a)
        out["sub_a_ok"] = bool(y.eq(world - 1).all())
        out["sub_a_size"] = dist.get_world_size(sub_a)
    if rank >= 1:
        z = torch.full((7,), 1.0)
        dist.all_reduce(z, group=sub_b)
        out["sub_b_ok"] = bool(z.eq(world - 1).all())
        out["sub_b_groups"] = _backend(sub_b).group_names()
    # Point to point between the first and the last rank (different groups).
    if rank == 0:
        dist.send(torch.arange(5000, dtype=torch.float64), dst=world - 1)
        back = torch.zeros(3, dtype=torch.int64)
        src = dist.recv(back)  # any source
        out["p2p_any_source"] = [int(src), back.tolist()]
    elif rank == world - 1:
        t = torch.zeros(5000, dtype=torch.float64)
        dist.recv(t, src=0)
        out["p2p_ok"] = bool(torch.equal(t, torch.arange(5000, dtype=torch.float64)))
        dist.send(torch.tensor([7, 8, 9]), dst=0)
    dist.barrier()
    out["segments_after_init"] = _segments()
    dist.destroy_process_group(sub_a) if rank in (0, world - 1) else None
    dist.destroy_process_group()


def _kill(out: dict, victim: int, after: int) -> None:
    """Rank `victim` SIGKILLs itself after `after` allreduces; survivors time the error."""
    rank = dist.get_rank()
    x = torch.ones(1 << 16)
    last_ok = time.monotonic()
    for i in range(after + 1000000):
        if rank == victim and i == after:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(x)
        except Exception as exc:  # noqa: BLE001 - the error is what we test
            out["error_after_s"] = time.monotonic() - last_ok
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["segments"] = _segments()
            return
        last_ok = time.monotonic()
        x.fill_(1.0)


def _waits(out: dict) -> None:
    """Work.wait(timeout) and the group timeout, without killing anyone."""
    rank = dist.get_rank()
    x = torch.full((100,), float(rank + 1))
    if rank == 0:
        work = dist.all_reduce(x, async_op=True)
        start = time.monotonic()
        try:
            work.wait(timeout=timedelta(milliseconds=300))
            out["short_wait"] = "returned"
        except Exception as exc:  # noqa: BLE001
            out["short_wait"] = str(exc)
        out["short_wait_s"] = time.monotonic() - start
        work.wait()
        out["late_result"] = x[0].item()
        out["future_value"] = work.get_future().value()[0][0].item()
    else:
        time.sleep(1.5)
        dist.all_reduce(x)
    dist.barrier()
    # Group timeout: rank 1 never joins this allreduce.
    dist.group.WORLD._get_backend(torch.device("cpu")).set_timeout(timedelta(seconds=1))
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(10))
            out["group_timeout"] = "returned"
        except Exception as exc:  # noqa: BLE001
            out["group_timeout"] = f"{type(exc).__name__}: {exc}"
        out["group_timeout_s"] = time.monotonic() - start
    else:
        time.sleep(3.0)


def main() -> int:
    scenario = sys.argv[1]
    timeout = timedelta(seconds=float(os.environ.get("KT_PG_TIMEOUT", "60")))
    out: dict = {"rank": int(os.environ["RANK"])}
    try:
        dist.init_process_group("kaitian", timeout=timeout)
        out["segments_after_init"] = _segments()
        if scenario == "layout":
            _layout(out)
        elif scenario == "kill":
            _kill(out, victim=int(sys.argv[2]), after=int(sys.argv[3]))
        elif scenario == "waits":
            _waits(out)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except Exception:  # noqa: BLE001
        out["exception"] = traceback.format_exc()
    print("RESULT " + json.dumps(out), flush=True)
    # Survivors of a killed peer must not hang in teardown; the OS cleans up.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
