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
2. measures all_reduce and broadcast bus bandwidth (nccl-tests formulas) for
   device tensors through kaitian, next to gloo on host copies of the same
   tensors (the path a user without kaitian would take).

Usage (on the GPU machine, from the repository root, after
``pip install --no-build-isolation -e .``)::

    python scripts/cuda_check.py                      # 1 CUDA rank + 1 CPU rank
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="kaitian: CUDA + CPU ranks correctness and bridge bandwidth")
    ap.add_argument("--cuda-ranks", type=int, default=1, help="ranks on CUDA devices (one GPU each; default 1)")
    ap.add_argument("--cpu-ranks", type=int, default=1, help="CPU ranks (default 1)")
    ap.add_argument("--sizes", default="4M,64M,256M", help="bandwidth sizes in bytes (default 4M,64M,256M)")
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
    if args.cuda_ranks > gpus:
        print(f"cuda_check: {args.cuda_ranks} CUDA rank(s) asked for but {gpus} GPU(s) visible; "
              f"use --cuda-ranks {gpus}", file=sys.stderr)
        return 2
    world = args.cuda_ranks + args.cpu_ranks
    if world < 2:
        print("cuda_check: need at least 2 ranks in total", file=sys.stderr)
        return 2
    run_dir = tempfile.mkdtemp(prefix="kaitian-cuda-check-")
    os.chmod(run_dir, 0o700)
    port = _free_port()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible_ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    procs = []
    print(f"cuda_check: {args.cuda_ranks} CUDA rank(s) ({torch.cuda.get_device_name(0) if gpus else 'none'}), "
          f"{args.cpu_ranks} CPU rank(s), torch {torch.__version__}", flush=True)
    try:
        for rank in range(world):
            env = dict(os.environ)
            env["KAITIAN_RUN_DIR"] = run_dir
            if rank < args.cuda_ranks:
                env.update(KAITIAN_DEVICE_TYPE="cuda", KAITIAN_DEVICE_INDEX=visible_ids[rank],
                           CUDA_VISIBLE_DEVICES=visible_ids[rank])
            else:
                env.update(KAITIAN_DEVICE_TYPE="cpu", KAITIAN_DEVICE_INDEX=str(rank - args.cuda_ranks),
                           CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
            cmd = [sys.executable, os.path.abspath(__file__), "--_worker", "--rank", str(rank),
                   "--world-size", str(world), "--init-method", f"tcp://127.0.0.1:{port}",
                   "--cuda-ranks", str(args.cuda_ranks), "--sizes", ",".join(str(s) for s in args.sizes),
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
        print("cuda_check: all checks passed")
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
