"""Worker: broadcast / all_reduce of ``nn.Parameter`` of every layout, vs gloo.

torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment; legacy
argv flags are ignored). Every rank checks, for contiguous, non-contiguous
(transposed) and channels_last Parameters, sync and async: the Parameter's
values equal gloo's result on a contiguous copy of the same input, it is still
a leaf Parameter that requires grad with its strides, and autograd still works
through it. One JSON line per case goes to the file named by ``KT_OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore")

LAYOUTS = ("contiguous", "noncontig", "channels_last")
OPS = ("broadcast", "all_reduce")


def make_param(layout: str, rank: int, salt: int) -> nn.Parameter:
    """A Parameter of ``layout`` with integer-valued entries (sums are exact)."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if layout == "channels_last":
        data = torch.randint(-50, 50, (2, 3, 4, 5), generator=g).float()
        data = data.to(memory_format=torch.channels_last)
    elif layout == "noncontig":
        data = torch.randint(-50, 50, (6, 8), generator=g).float().t()
    else:
        data = torch.randint(-50, 50, (7, 5), generator=g).float()
    return nn.Parameter(data)


def check_case(layout: str, op: str, async_op: bool, rank: int, ref_group, salt: int) -> None:
    p = make_param(layout, rank, salt)
    strides = p.stride()
    expected = p.detach().contiguous().clone()
    if op == "broadcast":
        dist.broadcast(expected, 0, group=ref_group)
        work = dist.broadcast(p, 0, async_op=async_op)
    else:
        dist.all_reduce(expected, group=ref_group)
        work = dist.all_reduce(p, async_op=async_op)
    if async_op:
        work.wait()
    assert isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad, "no longer a leaf Parameter"
    assert p.stride() == strides, f"strides changed from {strides} to {p.stride()}"
    assert torch.equal(p.detach(), expected), (
        f"values differ from gloo: {(p.detach() != expected).sum().item()} of {p.numel()} elements")
    (p * 2).sum().backward()
    assert p.grad is not None and torch.equal(p.grad, torch.full_like(p, 2.0)), "autograd broken"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="kaitian")
    args, _ = ap.parse_known_args(argv)
    import kaitian  # noqa: F401  registers the backend

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    ref = dist.new_group(backend="gloo")
    failures = 0
    with open(os.environ["KT_OUT"], "a") as out:
        salt = 0
        for layout in LAYOUTS:
            for op in OPS:
                for async_op in (False, True):
                    salt += 1
                    name = f"{op}-{layout}" + ("-async" if async_op else "")
                    try:
                        check_case(layout, op, async_op, rank, ref, salt)
                        rec = {"case": name, "ok": True, "msg": ""}
                    except Exception as exc:  # reported per case
                        failures += 1
                        rec = {"case": name, "ok": False,
                               "msg": f"{type(exc).__name__}: {exc}"[:500],
                               "trace": traceback.format_exc()[-1500:]}
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
    dist.barrier(group=ref)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
