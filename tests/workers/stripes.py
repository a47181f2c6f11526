"""One rank of the stripe-weights tests (kaitian.backend.stripes); KT_CASE picks:

``exact``: all_reduce under several stripe weights (one rank's 0 included) on
float32/float64/int64/bfloat16 and AVG, against gloo on the same ranks and
data; records each rank's host-reduced elements per weighting, the errors of
bad weights, and what balance_stripes set on each rank. ``disagree``: rank 0
and rank 1 set different weights; records the errors of that all_reduce and
of the next collective, and how long the first took.
"""
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import kaitian  # noqa: F401
from kaitian.backend import stripes

dist.init_process_group("kaitian", timeout=timedelta(seconds=30))
gloo = dist.new_group(backend="gloo")
rank, world, case = dist.get_rank(), dist.get_world_size(), os.environ["KT_CASE"]
out = {}


def first_line(call):
    try:
        call()
        return None
    except Exception as e:  # noqa: BLE001 (the test checks the message)
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


if case == "exact":
    out["mismatches"], out["reduced"] = [], {}
    for weights in (None, [3, 1, 0], [0, 0, 1], [1, 5, 2]):
        stripes.set_stripe_weights(weights)
        assert stripes.stripe_weights() == weights
        before = stripes.kaitian_backend().reduce_rate()[0]
        for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
            for n in (1, 7, 100_003):
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX) + ((dist.ReduceOp.AVG,) if dtype.is_floating_point else ()):
                    # small integers: every summation order gives the same result
                    g = torch.Generator().manual_seed(1000 * rank + n)
                    x = torch.randint(-20, 20, (n,), generator=g).to(dtype)
                    ours, ref = x.clone(), x.clone().double()
                    dist.all_reduce(ours, op=op)
                    dist.all_reduce(ref, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=gloo)
                    if op == dist.ReduceOp.AVG:
                        ref /= world
                    if not torch.equal(ours.double(), ref.to(dtype).double()):
                        out["mismatches"].append(f"{weights} {dtype} n={n} {op}")
        out["reduced"][str(weights)] = stripes.kaitian_backend().reduce_rate()[0] - before
    out["bad"] = [first_line(lambda w=w: stripes.set_stripe_weights(w))
                  for w in ([1, 2], [-1, 1, 1], [0, 0, 0], [1.5, 1, 1])]
    t = torch.ones(5)
    dist.all_reduce(t)  # bad weights left nothing behind
    out["after_bad"] = t.tolist()
    out["balanced"] = stripes.balance_stripes(min_spread=1.0)
    t = torch.ones(100_003)
    dist.all_reduce(t)
    out["after_balance_ok"] = bool((t == world).all())
else:  # disagree
    stripes.set_stripe_weights([1, 1, 2] if rank == 0 else [1, 2, 1] if rank == 1 else None)
    start = time.monotonic()
    out["error"] = first_line(lambda: dist.all_reduce(torch.ones(100_003)))
    out["seconds"] = time.monotonic() - start
    out["after"] = first_line(lambda: dist.all_reduce(torch.ones(1)))
with open(os.environ["KT_OUT"], "w") as f:
    json.dump(out, f)
dist.barrier(group=gloo)
dist.destroy_process_group()
