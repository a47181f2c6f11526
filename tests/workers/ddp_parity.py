"""One rank of the DDP comparison: the same training on kaitian and on gloo.

Every rank builds two identical models, wraps one in DDP over the process group
under test (the default group) and one in DDP over a gloo group on the same
ranks, feeds both the same per-rank batches for a few steps and writes, per
variant (plain, comm hooks, ...), the largest parameter difference between the
two to ``KT_OUT`` as one JSON line.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from support.worker_env import rank_env
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["VARIANTS", "main"]



def _powersgd(pg):
    # Compression starts at step 2: steps 0-1 all-reduce plainly, later steps
    # issue and wait for collectives inside the hook's future callbacks.
    state = powerSGD_hook.PowerSGDState(process_group=pg, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2, random_seed=0)
    return state, powerSGD_hook.powerSGD_hook


def _nested_allreduce_hook(pg, bucket):
    """Averages the bucket, then issues and waits for two more collectives
    inside the ``.then()`` callback (one via Work.wait, one via Future.wait)."""
    fut = dist.all_reduce(bucket.buffer(), group=pg, async_op=True).get_future()

    def rescale(f):
        world = torch.ones(1)
        dist.all_reduce(world, group=pg)
        again = torch.ones(1)
        dist.all_reduce(again, group=pg, async_op=True).get_future().wait()
        return f.value()[0] / (world * again / dist.get_world_size(pg)).item() / dist.get_world_size(pg)

    return fut.then(rescale)


# variant -> (DDP keyword arguments, comm hook or None, parameter tolerance);
# _powersgd builds its (state, hook) per process group.
VARIANTS = {
    "plain": ({}, None, 1e-5),
    "small-buckets": ({"bucket_cap_mb": 0.01}, None, 1e-5),
    "allreduce_hook": ({}, default_hooks.allreduce_hook, 1e-5),
    "fp16_compress_hook": ({}, default_hooks.fp16_compress_hook, 2e-3),
    "static_graph": ({"static_graph": True}, None, 1e-5),
    "no_sync": ({}, None, 1e-5),
    "powerSGD_hook": ({}, _powersgd, 1e-4),
    "nested_then_hook": ({}, _nested_allreduce_hook, 1e-5),
}
STEPS = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def _train(model: nn.Module, rank: int, variant: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(STEPS):
        # Unequal batches per rank: the groups are not the same size either.
        x = torch.randn(8 + 4 * rank, 32, generator=g)
        y = torch.randint(0, 10, (8 + 4 * rank,), generator=g)
        if variant == "no_sync" and step % 2 == 0:
            with model.no_sync():  # gradient accumulation: no communication on this step
                nn.functional.cross_entropy(model(x), y).backward()
            continue
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _run(args: argparse.Namespace) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    if args.backend == "kaitian":
        import kaitian  # noqa: F401  registers the backend
    timeout = timedelta(seconds=60)
    me = rank_env()
    dist.init_process_group(args.backend, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    dut = ref = None
    with open(me.out, "w") as out:
        for variant, (kwargs, hook, tol) in VARIANTS.items():
            rec = {"case": variant}
            try:
                dut = DDP(_model(), **kwargs)
                ref = DDP(_model(), process_group=gloo, **kwargs)
                if hook is _powersgd:
                    dut.register_comm_hook(*_powersgd(None))
                    ref.register_comm_hook(*_powersgd(gloo))
                elif hook is not None:
                    dut.register_comm_hook(None, hook)
                    ref.register_comm_hook(gloo, hook)
                start = [p.detach().clone() for p in ref.parameters()]
                _train(dut, me.rank, variant)
                _train(ref, me.rank, variant)
                diff = max(float((a - b).abs().max()) for a, b in zip(dut.parameters(), ref.parameters()))
                moved = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), start))
                # every rank must hold the same parameters
                flat = torch.cat([p.detach().reshape(-1) for p in dut.parameters()])
                spread = flat.clone()
                dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=gloo)
                spread = float((spread - flat).abs().max())
                rec.update(ok=diff <= tol and moved > 1e-3 and spread == 0.0, diff=diff, tol=tol, moved=moved,
                           spread=spread, msg="")
            except Exception as e:  # a backend error fails this variant
                rec.update(ok=False, msg=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}")
            out.write(json.dumps(rec) + "\n")
            out.flush()
            dist.barrier(group=gloo)
    # torch/gloo teardown deadlock (seen here, not kaitian's): destroying the
    # last DDP drops the gloo ProcessGroup, whose destructor joins gloo's
    # worker threads while this thread holds the GIL - and a worker thread may
    # still be freeing a finished barrier Work whose Python tensors need the
    # GIL. Drop the models first and let those threads finish, GIL released.
    dut = ref = None
    gc.collect()
    time.sleep(0.5)
    dist.destroy_process_group()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="kaitian")
    return _run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
