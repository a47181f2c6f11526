#!/usr/bin/env python3
"""Checks backend kaitian on a GPU machine: CUDA ranks + CPU ranks in one job.

Starts ``--cuda-ranks`` ranks on CUDA devices (group ``cuda``: NCCL inside the
group, pinned shared-memory bridge) and ``--cpu-ranks`` CPU ranks (group
``cpu``: gloo) on this host, as ``kaitianrun`` would (``KAITIAN_DEVICE_TYPE``,
``KAITIAN_DEVICE_INDEX``, ``CUDA_VISIBLE_DEVICES`` hidden from CPU ranks).
Every rank then:

1. checks all_reduce (SUM, AVG, MAX; float32, bfloat16, float16, int64),
   broadcast from every rank, all_gather (list and into-tensor) and
   reduce_scatter_tensor against a reference computed on the CPU from the
   known inputs of every rank; device tensors must stay on their device;
2. checks what only a GPU shows (stream order and completion): a producer
   kernel on a non-default stream, not synchronised, right before the
   collective; several-MiB reduce_scatter_tensor read right after wait();
   async ops (wait() and get_future()); non-contiguous and channels_last
   tensors and nn.Parameters (broadcast, all_reduce); reduce at the root and
   all_reduce_coalesced; bitwise ops and bool/int16 (which NCCL cannot reduce,
   routed through the bridge);
3. measures all_reduce and broadcast bus bandwidth (nccl-tests formulas) for
   device tensors through kaitian, next to gloo on host copies of the same
   tensors (the path a user without kaitian would take).

With two or more GPUs the default is 2 CUDA ranks (NCCL inside the CUDA
group), and the checks run a second time in an all-CUDA world (no CPU rank:
NCCL alone, no host staging).

Usage (on the GPU machine, from the repository root, after
``pip install --no-build-isolation -e .``)::

    python scripts/cuda_check.py                      # min(2, GPUs) CUDA ranks + 1 CPU rank
    python scripts/cuda_check.py --cuda-ranks 2 --cpu-ranks 2 --sizes 64M,256M
    python scripts/cuda_check.py --cuda-ranks 0       # CPU-only dry run of the script itself

Exit status 0 when every check passed, 1 otherwise; one line per check.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from datetime import timedelta

__all__ = ["main"]

# Run from a checkout as well as from an installed kaitian.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def _input(dtype, n: int, rank: int, salt: str):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{salt}/{rank}".encode()))
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import kaitian  # noqa: F401  registers the backend

    rank, world = args.rank, args.world_size
    is_cuda = rank < args.cuda_ranks
    if is_cuda:
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES holds this rank's one GPU
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    dist.init_process_group("kaitian", init_method=args.init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    failures = 0

    def report(name: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        flags = torch.tensor([0 if ok else 1])
        dist.all_reduce(flags, group=gloo)  # one line per check, for all ranks
        bad = int(flags)
        failures += 1 if (bad and rank == 0) else 0
        if rank == 0:
            print(f"{'PASS' if not bad else 'FAIL'}  {name}" + (f"  ({bad} rank(s) wrong) {detail}" if bad else ""),
                  flush=True)

    def close(got, exp, dtype) -> bool:
        if got.device != device:
            return False
        got = got.cpu()
        if dtype in (torch.float16, torch.bfloat16):
            return bool(torch.allclose(got.double(), exp.double(), rtol=2e-2, atol=0.1 * world))
        if dtype.is_floating_point:
            return bool(torch.allclose(got.double(), exp.double(), rtol=1e-5, atol=1e-4))
        return bool(torch.equal(got, exp.to(got.dtype)))

    n = 100_003
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        inputs = [_input(dtype, n, r, f"ar{dtype}") for r in range(world)]
        for op in ("SUM", "AVG", "MAX"):
            if op == "AVG" and not dtype.is_floating_point:
                continue
            stack = torch.stack([x.double() for x in inputs])
            exp = {"SUM": stack.sum(0), "AVG": stack.mean(0), "MAX": stack.max(0).values}[op]
            t = inputs[rank].to(device, copy=True)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            report(f"all_reduce {op} {dtype}", close(t, exp.to(dtype) if op == "MAX" else exp, dtype))
        for src in range(world):
            t = inputs[rank].to(device, copy=True)
            dist.broadcast(t, src)
            report(f"broadcast {dtype} from rank {src} ({'cuda' if src < args.cuda_ranks else 'cpu'})",
                   close(t, inputs[src], dtype))
        out = [torch.empty(n, dtype=dtype, device=device) for _ in range(world)]
        dist.all_gather(out, inputs[rank].to(device, copy=True))
        report(f"all_gather {dtype}", all(close(o, inputs[r], dtype) for r, o in enumerate(out)))
        flat = torch.empty(n * world, dtype=dtype, device=device)
        dist.all_gather_into_tensor(flat, inputs[rank].to(device, copy=True))
        report(f"all_gather_into_tensor {dtype}", close(flat, torch.cat(inputs), dtype))
        if dtype != torch.int64:
            full = [_input(dtype, 64 * world, r, f"rs{dtype}") for r in range(world)]
            exp = torch.stack([x.double() for x in full]).sum(0)[rank * 64:(rank + 1) * 64]
            out = torch.empty(64, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(out, full[rank].to(device, copy=True))
            report(f"reduce_scatter_tensor SUM {dtype}", close(out, exp, dtype))

    _stream_and_layout_checks(args, device, report, close)
    if not args.sizes:
        dist.destroy_process_group()
        return 1 if failures else 0
    if rank == 0:
        print(f"\nbandwidth ({args.cuda_ranks} CUDA + {world - args.cuda_ranks} CPU ranks; busbw as nccl-tests; "
              f"gloo = host copies through gloo)", flush=True)
        print(f"{'op':<10}{'size':>10}{'kaitian ms':>12}{'busbw GB/s':>12}{'gloo ms':>10}{'busbw GB/s':>12}"
              f"{'ratio':>8}", flush=True)
    for op in ("allreduce", "broadcast"):
        for nbytes in args.sizes:
            elems = nbytes // 4
            t = torch.ones(elems, device=device)

            def run_kaitian():
                if op == "allreduce":
                    dist.all_reduce(t)
                else:
                    dist.broadcast(t, world - 1)

            def run_gloo():
                # what a job without kaitian does: device -> host, gloo, host -> device
                host = t.cpu()
                if op == "allreduce":
                    dist.all_reduce(host, group=gloo)
                else:
                    dist.broadcast(host, world - 1, group=gloo)
                t.copy_(host)

            times = {}
            for name, fn in (("kaitian", run_kaitian), ("gloo", run_gloo)):
                fn()
                if is_cuda:
                    torch.cuda.synchronize()
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(args.iters):
                    fn()
                if is_cuda:
                    torch.cuda.synchronize()
                sec = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64)
                dist.all_reduce(sec, op=dist.ReduceOp.MAX, group=gloo)
                times[name] = float(sec)
            factor = 2 * (world - 1) / world if op == "allreduce" else 1.0
            bw = {k: nbytes / v / 1e9 * factor for k, v in times.items()}
            if rank == 0:
                print(f"{op:<10}{nbytes >> 20:>7} MiB{times['kaitian'] * 1e3:>12.2f}{bw['kaitian']:>12.2f}"
                      f"{times['gloo'] * 1e3:>10.2f}{bw['gloo']:>12.2f}{bw['kaitian'] / bw['gloo']:>7.2f}x",
                      flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


def _stream_and_layout_checks(args, device, report, close) -> None:
    """The checks a GPU adds: stream order, completion, layouts, routed dtypes/ops."""
    import contextlib
    import functools

    import torch
    import torch.distributed as dist
    from torch import nn

    rank, world = args.rank, args.world_size
    is_cuda = device.type == "cuda"
    ranks_sum = world * (world + 1) // 2

    def on_side_stream():
        return torch.cuda.stream(torch.cuda.Stream()) if is_cuda else contextlib.nullcontext()

    def busy():  # keeps the current stream busy, so that a missing wait shows
        if is_cuda:
            torch.cuda._sleep(20_000_000)

    # 1. A producer kernel on a non-default stream, no sync, then the collective;
    #    the result is read on that stream straight after.
    n = 1 << 20
    with on_side_stream():
        busy()
        t = torch.full((n,), float(rank + 1), device=device)
        dist.all_reduce(t)
        ok = bool((t == ranks_sum).all())
    report("all_reduce after an unsynchronised producer on a side stream", ok)
    with on_side_stream():
        busy()
        t = torch.full((n,), float(rank + 1), device=device)
        dist.broadcast(t, world - 1)
        ok = bool((t == world).all())
    report("broadcast after an unsynchronised producer on a side stream", ok)

    # 2. reduce_scatter_tensor of several MiB, used right after wait().
    m = (6 << 20) // 4
    base = (torch.arange(world * m, device=device) % 1000).float()
    out = torch.empty(m, device=device)
    busy()
    work = dist.reduce_scatter_tensor(out, base + rank, async_op=True)
    work.wait()
    exp = world * base[rank * m:(rank + 1) * m] + (ranks_sum - world)
    report("reduce_scatter_tensor 6 MiB/rank read right after wait()", bool(torch.equal(out, exp)))

    # 3. Async ops: wait() and get_future().
    t = torch.full((n,), float(rank + 1), device=device)
    busy()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    report("async all_reduce, read after wait()", bool((t == ranks_sum).all()))
    t = torch.full((n,), float(rank + 1), device=device)
    fut = dist.all_reduce(t, async_op=True).get_future()
    got = fut.wait()[0]
    report("async all_reduce, read from get_future().wait()", bool((got == ranks_sum).all()))
    t = torch.full((n,), float(rank), device=device)
    work = dist.broadcast(t, 0, async_op=True)
    work.wait()
    report("async broadcast, read after wait()", bool((t == 0).all()))

    # 4. Non-contiguous / channels_last tensors and Parameters.
    def shaped(kind: str, r: int, salt: int):
        g = torch.Generator().manual_seed(97 * salt + r)
        if kind == "channels_last":
            x = torch.randint(-50, 50, (2, 3, 4, 5), generator=g).float()
            return x.to(memory_format=torch.channels_last)
        if kind == "noncontig":
            return torch.randint(-50, 50, (6, 8), generator=g).float().t()
        return torch.randint(-50, 50, (7, 5), generator=g).float()

    for salt, kind in enumerate(("contiguous", "noncontig", "channels_last")):
        inputs = [shaped(kind, r, salt) for r in range(world)]
        total = sum(x.contiguous() for x in inputs)
        for param in (False, True):
            what = "Parameter" if param else "tensor"
            for async_op in (False, True):
                suffix = " (async)" if async_op else ""
                x = inputs[rank].to(device, copy=True)
                x = nn.Parameter(x) if param else x
                strides = x.stride()
                w = dist.all_reduce(x, async_op=async_op)
                if async_op:
                    w.wait()
                ok = x.stride() == strides and close(x.detach(), total, torch.float32)
                ok = ok and (not param or (x.is_leaf and x.requires_grad))
                report(f"all_reduce {kind} {what}{suffix}", ok)
                x = inputs[rank].to(device, copy=True)
                x = nn.Parameter(x) if param else x
                w = dist.broadcast(x, 0, async_op=async_op)
                if async_op:
                    w.wait()
                report(f"broadcast {kind} {what}{suffix}", close(x.detach(), inputs[0], torch.float32))
    t = shaped("noncontig", rank, 7).to(device, copy=True)
    dist.reduce(t, dst=0)
    exp = sum(shaped("noncontig", r, 7) for r in range(world)) if rank == 0 else shaped("noncontig", rank, 7)
    report("reduce of a non-contiguous tensor (root gets the sum, others keep theirs)",
           close(t, exp, torch.float32))
    if hasattr(dist, "all_reduce_coalesced"):
        ts = [torch.full((1000,), float(rank + 1), device=device),
              torch.full((3, 7), float(2 * rank), device=device).t()]
        dist.all_reduce_coalesced(ts)
        report("all_reduce_coalesced (one non-contiguous)",
               bool((ts[0] == ranks_sum).all()) and bool((ts[1] == 2 * (ranks_sum - world)).all()))

    # 5. What NCCL cannot reduce goes through the bridge: bitwise ops, bool, int16.
    bitwise = {"BAND": lambda a, b: a & b, "BOR": lambda a, b: a | b, "BXOR": lambda a, b: a ^ b}
    for dtype in (torch.int32, torch.int64, torch.uint8):
        inputs = [_input(dtype, 10_001, r, f"bit{dtype}") for r in range(world)]
        for op, fn in bitwise.items():
            t = inputs[rank].to(device, copy=True)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            report(f"all_reduce {op} {dtype}", close(t, functools.reduce(fn, inputs), dtype))
    for dtype, ops in ((torch.int16, ("SUM", "MIN", "MAX")), (torch.bool, ("MIN", "MAX"))):
        if dtype == torch.bool:
            inputs = [_input(torch.int64, 10_001, r, "bool") > 0 for r in range(world)]
        else:
            inputs = [(_input(dtype, 10_001, r, "i16") // 8).to(dtype) for r in range(world)]
        stack = torch.stack([x.long() for x in inputs])
        for op in ops:
            exp = {"SUM": stack.sum(0), "MIN": stack.min(0).values, "MAX": stack.max(0).values}[op]
            t = inputs[rank].to(device, copy=True)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            report(f"all_reduce {op} {dtype}", close(t, exp, dtype))
        t = inputs[rank].to(device, copy=True)
        dist.broadcast(t, world - 1)
        report(f"broadcast {dtype}", close(t, inputs[world - 1], dtype))
        outs = [torch.empty_like(inputs[0], device=device) for _ in range(world)]
        dist.all_gather(outs, inputs[rank].to(device))
        report(f"all_gather {dtype}", all(close(o, inputs[r], dtype) for r, o in enumerate(outs)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="kaitian: CUDA + CPU ranks correctness and bridge bandwidth")
    ap.add_argument("--cuda-ranks", type=int, default=None,
                    help="ranks on CUDA devices (one GPU each; default: 2 when 2 GPUs are visible, else 1)")
    ap.add_argument("--cpu-ranks", type=int, default=None,
                    help="CPU ranks (default 1; 2 with --cuda-ranks 0)")
    ap.add_argument("--sizes", default="4M,64M,256M",
                    help="bandwidth sizes in bytes (default 4M,64M,256M; empty: checks only)")
    ap.add_argument("--iters", type=int, default=10, help="calls per bandwidth measurement")
    ap.add_argument("--timeout", type=float, default=540, help="seconds before every rank is stopped")
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world-size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init-method", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [_parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args._worker:
        return _worker(args)

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.cuda_ranks is None:
        args.cuda_ranks = min(2, max(1, gpus))
    if args.cpu_ranks is None:
        args.cpu_ranks = 1 if args.cuda_ranks else 2
    if args.cuda_ranks > gpus:
        print(f"cuda_check: {args.cuda_ranks} CUDA rank(s) asked for but {gpus} GPU(s) visible; "
              f"use --cuda-ranks {gpus}", file=sys.stderr)
        return 2
    if args.cuda_ranks + args.cpu_ranks < 2:
        print("cuda_check: need at least 2 ranks in total", file=sys.stderr)
        return 2
    print(f"cuda_check: {args.cuda_ranks} CUDA rank(s) ({torch.cuda.get_device_name(0) if gpus else 'none'}), "
          f"{args.cpu_ranks} CPU rank(s), torch {torch.__version__}", flush=True)
    code = _launch(args, args.cuda_ranks, args.cpu_ranks, args.sizes, gpus)
    if code == 0 and args.cuda_ranks >= 2 and args.cpu_ranks > 0:
        print(f"\ncuda_check: the checks again in an all-CUDA world ({args.cuda_ranks} CUDA ranks, "
              f"NCCL alone)", flush=True)
        code = _launch(args, args.cuda_ranks, 0, [], gpus)
    if code == 0:
        print("cuda_check: all checks passed")
    return code


def _launch(args: argparse.Namespace, cuda_ranks: int, cpu_ranks: int, sizes, gpus: int) -> int:
    """Starts one job of ``cuda_ranks`` + ``cpu_ranks`` ranks; its exit status."""
    world = cuda_ranks + cpu_ranks
    run_dir = tempfile.mkdtemp(prefix="kaitian-cuda-check-")
    os.chmod(run_dir, 0o700)
    port = _free_port()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible_ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ)
            env["KAITIAN_RUN_DIR"] = run_dir
            if rank < cuda_ranks:
                env.update(KAITIAN_DEVICE_TYPE="cuda", KAITIAN_DEVICE_INDEX=visible_ids[rank],
                           CUDA_VISIBLE_DEVICES=visible_ids[rank])
            else:
                env.update(KAITIAN_DEVICE_TYPE="cpu", KAITIAN_DEVICE_INDEX=str(rank - cuda_ranks),
                           CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
            cmd = [sys.executable, os.path.abspath(__file__), "--_worker", "--rank", str(rank),
                   "--world-size", str(world), "--init-method", f"tcp://127.0.0.1:{port}",
                   "--cuda-ranks", str(cuda_ranks), "--sizes", ",".join(str(s) for s in sizes),
                   "--iters", str(args.iters)]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                          stdout=None if rank == 0 else subprocess.DEVNULL))
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if any(c is None for c in codes):
            print(f"cuda_check: ranks still running after {args.timeout:.0f}s or a peer failed; "
                  f"exit codes {codes}", file=sys.stderr)
            return 1
        if any(codes):
            print(f"cuda_check: FAILED (rank exit codes {codes})", file=sys.stderr)
            return 1
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
