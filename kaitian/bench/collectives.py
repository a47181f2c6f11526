"""``kaitian bench collectives``: kaitian vs gloo on the same ranks, in one run.

Starts ``--nproc`` ranks on this host split into ``--groups`` simulated vendor
groups (``KAITIAN_GROUP`` = ``cpu0``, ``cpu1``, … in contiguous blocks, as
``kaitianrun --cpu-groups`` does). Every rank joins backend kaitian (the
default group) and a gloo group over the same ranks; for each op and size the
same tensors are timed on both. Printed per op and size: latency (the slowest
rank's mean time per call) and bus bandwidth with the nccl-tests formulas,
for kaitian and gloo, and the kaitian/gloo ratios. Then a DDP training step
(kaitian vs gloo, same model and data) and the issue's targets.

Example::

    kaitian bench collectives                            # 2 ranks, 2 groups, all ops, 4 KiB .. 64 MiB
    kaitian bench collectives --ops allreduce --sizes 4K,64M --iters 50
    kaitian bench collectives --nproc 4 --groups 2 --bridge tcp
    kaitian bench collectives --memory 2,4,8,16          # shared memory per group and per process
    kaitian bench collectives --nproc 4 --cpu-quota 1,0.1 --stripes weighted --ops allreduce

``--cpu-quota`` gives each group a share of CPU time, as ``kaitianrun
--cpu-quota`` does (a slow simulated device). ``--stripes weighted`` also times
kaitian with stripe weights from ``kaitian.backend.stripes.balance_stripes``
(each rank's stripe of the cross-group reduction in proportion to its measured
host reduce speed, set after the warm-up), beside even stripes and gloo.

``--memory`` starts one job per world size instead of timing: after a 64 MiB
all_reduce and a point-to-point ring (so the collective slots and mailboxes
are in use) it prints the bytes of ``/dev/shm`` the kaitian segments hold per
group (the pages every rank's own segment has allocated) and per process (the
segment pages each process has mapped in), and the change of ``/dev/shm`` use
seen by ``statvfs`` (other jobs on the host move that one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

from kaitian.bench import BenchParser
from kaitian.bench.session import stop_session
from kaitian.devices.device import WorkerDevice
from kaitian.settings import Settings

__all__ = ["main", "bus_bandwidth", "parse_size", "OPS"]

# op -> bus bandwidth factor given n ranks (nccl-tests' PERFORMANCE.md); the
# size of a run is the per-rank buffer that the op's "S" refers to there.
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall")
_DEFAULT_SIZES = "4K,64K,1M,4M,16M,64M"


def bus_bandwidth(op: str, nbytes: int, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s as nccl-tests computes it.

    Args:
        op: one of ``OPS``.
        nbytes: S, the size nccl-tests uses for the op (allreduce/broadcast/
            reduce: the buffer; allgather: the gathered output; reduce_scatter:
            the full input; alltoall: the full per-rank buffer).
        seconds: time per call.
        nranks: number of ranks.

    Returns:
        busbw in GB/s (1e9 bytes per second).
    """
    if seconds <= 0:
        return float("nan")
    algbw = nbytes / seconds / 1e9
    n = nranks
    factor = {
        "allreduce": 2 * (n - 1) / n,
        "allgather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "alltoall": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
    }[op]
    return algbw * factor


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"64M"`` -> 67108864, ``"100"`` -> 100 (bytes).

    Raises:
        ValueError: not a size.
    """
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    try:
        value = int(float(number) * mult)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (examples: 4K, 1M, 64M)") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def _fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _iters_for(nbytes: int, requested: Optional[int]) -> int:
    if requested:
        return requested
    # about 512 MiB moved per measurement, between 15 and 200 calls (spread
    # over 5 rounds: even the largest size gets 3 calls a round)
    return max(15, min(200, (512 << 20) // max(nbytes, 1)))


# --------------------------------------------------------------------------- worker


def _shm_mappings() -> Dict[str, int]:
    """Bytes of kaitian shared memory in this process: own segment resident, all mapped/resident."""
    own = f"-{os.getpid()}-"
    out = {"own_rss": 0, "rss": 0, "size": 0}
    current = None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                path = parts[5] if len(parts) > 5 else ""
                current = path if "/kaitian-" in path else None
            elif current and parts[0] in ("Size:", "Rss:"):
                kib = int(parts[1]) * 1024
                if parts[0] == "Size:":
                    out["size"] += kib
                else:
                    out["rss"] += kib
                    if own in current:
                        out["own_rss"] += kib
    return out


def _shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _memory_worker(args: argparse.Namespace) -> int:
    """One rank of ``--memory``: use the bridge, then report its shared memory."""
    import torch
    import torch.distributed as dist

    import kaitian  # noqa: F401  registers the backend

    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    dist.init_process_group(args.backend, timeout=timeout)  # torchrun's environment (see _launch)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    n, rank = dist.get_world_size(), dist.get_rank()
    t = torch.ones(16 << 20)  # 64 MiB
    dist.all_reduce(t)
    ring = torch.ones(1 << 18)  # 1 MiB to the next rank
    reqs = [dist.isend(ring, (rank + 1) % n), dist.irecv(torch.empty_like(ring), (rank - 1) % n)]
    for r in reqs:
        r.wait()
    dist.barrier()
    rec = _shm_mappings()
    rec["statvfs_used"] = _shm_used()
    recs: List[dict] = [{}] * n
    dist.all_gather_object(recs, rec, group=gloo)
    if rank == 0:
        per_group = sum(r["own_rss"] for r in recs)
        per_proc = max(r["rss"] for r in recs)
        mapped = max(r["size"] for r in recs)
        delta = rec["statvfs_used"] - args.shm_baseline
        print(f"{n:>5} {per_group / 2**20:>14.1f} {per_group / n / 2**20:>13.2f} {per_proc / 2**20:>14.1f} "
              f"{mapped / 2**20:>12.1f} {delta / 2**20:>15.1f}", flush=True)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 0


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import kaitian  # noqa: F401  registers the backend

    if args.memory:
        return _memory_worker(args)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    timeout = timedelta(seconds=120)
    dist.init_process_group(args.backend, timeout=timeout)  # torchrun's environment (see _launch)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    n, rank = dist.get_world_size(), dist.get_rank()
    results: List[dict] = []

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
        return float(t)

    def timed_pair(fns: Dict[str, object], iters: int) -> Dict[str, float]:
        """Mean seconds per call of each backend's ``fn`` (slowest rank).

        The backends take turns in several rounds and the median round counts,
        so load from other processes on the host hits both alike.
        """
        rounds = 5
        per_round = max(1, -(-iters // rounds))
        samples: Dict[str, List[float]] = {k: [] for k in fns}
        for name, fn in fns.items():  # warm-up (buffers, connections)
            for _ in range(2):
                fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(per_round):
                    fn()
                samples[name].append(slowest((time.perf_counter() - start) / per_round))
        return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}

    weights = None
    if args.stripes == "weighted":
        from kaitian.backend import stripes

        # the speeds: host reductions of a few warm-up all_reduces
        warm = torch.ones(4 << 20)
        for _ in range(3):
            dist.all_reduce(warm)
        weights = stripes.balance_stripes(min_spread=1.0)
        if rank == 0:
            print(f"stripe weights from measured reduce speeds: {weights}", flush=True)

    def with_weights(fn, w):
        def call():  # every rank sets them at the same call, as balance_stripes requires
            stripes.set_stripe_weights(w)
            fn()
        return call

    for op in args.ops:
        for nbytes in args.sizes:
            elems = max(1, nbytes // 4)
            iters = _iters_for(nbytes, args.iters)
            row = {"op": op, "bytes": nbytes, "iters": iters}
            fns = {}
            for name, group in (("kaitian", None), ("gloo", gloo)):
                fns[name], size = _make_op(op, elems, n, group)
            if weights is not None:
                fns["weighted"] = with_weights(fns["kaitian"], weights)
                fns["kaitian"] = with_weights(fns["kaitian"], None)
            for name, sec in timed_pair(fns, iters).items():
                row[name] = {"seconds": sec, "busbw": bus_bandwidth(op, size, sec, n)}
            results.append(row)
            if rank == 0:
                _print_row(row)

    ddp = _ddp_steps(args, gloo) if args.ddp_steps > 0 else None
    if rank == 0:
        _print_ddp_and_targets(results, ddp)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"nproc": n, "groups": args.groups, "collectives": results, "ddp": ddp}, fh, indent=1)
    dist.destroy_process_group()
    return 0


def _make_op(op: str, elems: int, n: int, group):
    """A zero-argument callable running ``op`` on fresh float32 buffers, and S in bytes."""
    import torch
    import torch.distributed as dist

    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    per = max(1, elems // n)
    if op == "allreduce":
        t = torch.ones(elems)
        return (lambda: dist.all_reduce(t, group=group)), elems * 4
    if op == "allgather":
        inp, out = torch.ones(per), torch.empty(per * n)
        return (lambda: all_gather(out, inp, group=group)), per * n * 4
    if op == "reduce_scatter":
        inp, out = torch.ones(per * n), torch.empty(per)
        return (lambda: reduce_scatter(out, inp, group=group)), per * n * 4
    if op == "broadcast":
        t = torch.ones(elems)
        return (lambda: dist.broadcast(t, 0, group=group)), elems * 4
    if op == "reduce":
        t = torch.ones(elems)
        return (lambda: dist.reduce(t, 0, group=group)), elems * 4
    if op == "alltoall":
        inp, out = torch.ones(per * n), torch.empty(per * n)
        return (lambda: dist.all_to_all_single(out, inp, group=group)), per * n * 4
    raise ValueError(op)  # validated by the parser


def _ddp_steps(args: argparse.Namespace, gloo) -> dict:
    """Mean DDP training step time on kaitian and on gloo (same model and data)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model() -> nn.Module:
        torch.manual_seed(0)
        width = args.ddp_width
        layers: List[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))

    x = torch.randn(args.ddp_batch, args.ddp_width)
    y = torch.randint(0, 10, (args.ddp_batch,))
    out = {}
    # Alternate the two backends in rounds so drifting load affects both alike.
    nets = {"kaitian": DDP(model()), "gloo": DDP(model(), process_group=gloo)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in nets.items()}
    times: Dict[str, List[float]] = {k: [] for k in nets}
    rounds = 3
    for r in range(rounds + 1):
        for name, net in nets.items():
            steps = 2 if r == 0 else args.ddp_steps
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(steps):
                nn.functional.cross_entropy(net(x), y).backward()
                opts[name].step()
                opts[name].zero_grad()
            if r > 0:  # round 0 is warm-up
                t = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
                times[name].append(float(t))
    for name, ts in times.items():
        out[name] = sorted(ts)[len(ts) // 2]
    params = sum(p.numel() for p in nets["gloo"].parameters())
    out.update(params=params, batch=args.ddp_batch)
    return out


# --------------------------------------------------------------------------- printing


_HEADER = (f"{'op':<15}{'size':>10}  {'kaitian us':>11}{'GB/s':>8}  {'gloo us':>10}{'GB/s':>8}  "
           f"{'lat kt/gloo':>11}{'bw kt/gloo':>11}")


def _print_row(row: dict) -> None:
    kt, gl = row["kaitian"], row["gloo"]
    if not getattr(_print_row, "_header_done", False):
        print(_HEADER)
        print("-" * len(_HEADER))
        _print_row._header_done = True  # type: ignore[attr-defined]
    print(f"{row['op']:<15}{_fmt_size(row['bytes']):>10}  {kt['seconds'] * 1e6:>11.1f}{kt['busbw']:>8.2f}  "
          f"{gl['seconds'] * 1e6:>10.1f}{gl['busbw']:>8.2f}  {kt['seconds'] / gl['seconds']:>11.3f}"
          f"{kt['busbw'] / gl['busbw']:>10.2f}x", flush=True)
    if "weighted" in row:
        wt = row["weighted"]
        print(f"{'  weighted':<25}  {wt['seconds'] * 1e6:>11.1f}{wt['busbw']:>8.2f}  "
              f"{'(even/weighted time ' + format(kt['seconds'] / wt['seconds'], '.2f') + 'x)':>18}", flush=True)


def _print_ddp_and_targets(results: List[dict], ddp: Optional[dict]) -> None:
    if ddp:
        ratio = ddp["kaitian"] / ddp["gloo"]
        print(f"\nDDP step ({ddp['params'] / 1e6:.1f} M parameters, batch {ddp['batch']} per rank): "
              f"kaitian {ddp['kaitian'] * 1e3:.1f} ms, gloo {ddp['gloo'] * 1e3:.1f} ms, "
              f"kaitian/gloo {ratio:.3f}")
    print("\ntargets (issue 2):")
    by_key = {(r["op"], r["bytes"]): r for r in results}
    big = by_key.get(("allreduce", 64 << 20))
    small = by_key.get(("allreduce", 4 << 10))
    if big:
        ratio = big["kaitian"]["busbw"] / big["gloo"]["busbw"]
        print(f"  allreduce 64 MiB float32 busbw >= 3x gloo: {ratio:.2f}x  {'MET' if ratio >= 3 else 'MISSED'}")
    if small:
        ratio = small["kaitian"]["seconds"] / small["gloo"]["seconds"]
        print(f"  allreduce 4 KiB latency <= 0.2x gloo:      {ratio:.3f}x {'MET' if ratio <= 0.2 else 'MISSED'}")
    if ddp:
        ratio = ddp["kaitian"] / ddp["gloo"]
        print(f"  DDP step no slower than gloo:              {ratio:.3f}x {'MET' if ratio <= 1.0 else 'MISSED'}")
    if not (big or small or ddp):
        print("  (not measured: include allreduce 4K and 64M and the DDP step)")


# --------------------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parser() -> argparse.ArgumentParser:
    ap = BenchParser(prog="kaitian bench collectives",
                     description="kaitian vs gloo collectives and DDP step, same ranks, one run")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start on this host (default 2)")
    ap.add_argument("--groups", type=int, default=2, help="simulated vendor groups (default 2)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    ap.add_argument("--sizes", default=_DEFAULT_SIZES, help=f"comma list of byte sizes (default {_DEFAULT_SIZES})")
    ap.add_argument("--iters", type=int, default=0, help="calls per measurement (default: by size)")
    ap.add_argument("--ddp-steps", type=int, default=10, help="DDP steps per round; 0 skips the DDP comparison")
    ap.add_argument("--ddp-width", type=int, default=1024, help="hidden width of the DDP benchmark MLP")
    ap.add_argument("--ddp-batch", type=int, default=64, help="DDP batch per rank")
    ap.add_argument("--bridge", choices=("auto", "shm", "tcp"), default=None, help="sets KAITIAN_BRIDGE for the ranks")
    ap.add_argument("--intra", choices=("auto", "gloo", "shm"), default=None, help="sets KAITIAN_INTRA for the ranks")
    ap.add_argument("--cpu-quota", default=None, metavar="Q0,Q1,...",
                    help="cores of CPU time per group, as kaitianrun --cpu-quota (e.g. 1,0.1)")
    ap.add_argument("--stripes", choices=("even", "weighted"), default="even",
                    help="weighted: also time kaitian with stripes weighted by measured reduce speed")
    ap.add_argument("--backend", default="kaitian",
                    help="backend measured against gloo (default kaitian; 'gloo' checks the bench itself)")
    ap.add_argument("--json", default="", help="also write the numbers to this JSON file")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before the ranks are stopped")
    ap.add_argument("--memory", default="", metavar="WORLDS",
                    help="instead of timing: shared memory per group and per process at these world sizes "
                         "(comma list, e.g. 2,4,8,16)")
    ap.add_argument("--shm-baseline", type=int, default=0, help=argparse.SUPPRESS)
    # internal: one rank
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def _validate(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.nproc < 2:
        ap.error("--nproc must be at least 2")
    if not 1 <= args.groups <= args.nproc:
        ap.error(f"--groups must be between 1 and --nproc ({args.nproc})")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        ap.error(f"unknown op {', '.join(unknown) or '(none)'}; choose from {', '.join(OPS)}")
    args.ops = ops
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as e:
        ap.error(str(e))
    if not args.sizes:
        ap.error("--sizes is empty")
    if args.cpu_quota is not None:
        from kaitian.errors import NodeWorkersError
        from kaitian.launcher.workers import parse_cpu_quota

        try:
            args.quotas = parse_cpu_quota(args.cpu_quota)
        except NodeWorkersError as e:
            ap.error(str(e))
        if len(args.quotas) != args.groups:
            ap.error(f"--cpu-quota has {len(args.quotas)} values for {args.groups} groups")
    if args.stripes == "weighted" and args.backend != "kaitian":
        ap.error("--stripes weighted measures backend kaitian")
    if args.iters < 0 or args.ddp_steps < 0:
        ap.error("--iters and --ddp-steps must not be negative")
    if args.memory:
        try:
            args.memory_worlds = [int(w) for w in args.memory.split(",") if w.strip()]
        except ValueError:
            ap.error(f"--memory takes world sizes such as 2,4,8,16, not {args.memory!r}")
        if not args.memory_worlds or min(args.memory_worlds) < 2:
            ap.error("--memory world sizes must be at least 2")


def _group_of(rank: int, nproc: int, groups: int) -> int:
    """Contiguous blocks of ranks, the first blocks one larger when uneven."""
    base, extra = divmod(nproc, groups)
    bounds, start = [], 0
    for g in range(groups):
        start += base + (1 if g < extra else 0)
        bounds.append(start)
    return next(g for g, end in enumerate(bounds) if rank < end)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``kaitian bench collectives``.

    Returns:
        0 on success; 1 if a rank failed; 2 on bad arguments.
    """
    ap = _parser()
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    _validate(ap, args)
    if args.worker:
        return _worker(args)

    base_argv = [a for a in (sys.argv[1:] if argv is None else list(argv))]
    if args.memory:
        print("kaitian bench collectives --memory: kaitian shared memory after a 64 MiB all_reduce and a "
              "1 MiB send/recv ring (MiB)", flush=True)
        print(f"{'world':>5} {'per group':>14} {'per rank':>13} {'per process':>14} {'mapped':>12} "
              f"{'statvfs delta':>15}", flush=True)
        for world in args.memory_worlds:
            groups = min(args.groups, world)
            rc = _launch(args, world, groups, base_argv + ["--nproc", str(world), "--groups", str(groups),
                                                           "--shm-baseline", str(_shm_used())])
            if rc:
                return rc
        print("per group: pages the ranks' own segments hold; per process: segment pages one process has "
              "mapped in (its own and the peers' it read); mapped: address space", flush=True)
        return 0
    groups_desc = [f"cpu{_group_of(r, args.nproc, args.groups)}" for r in range(args.nproc)]
    quotas = getattr(args, "quotas", None)
    limited = f" at {', '.join(f'{q:g}' for q in quotas)} cores of CPU time" if quotas else ""
    print(f"kaitian bench collectives: {args.nproc} ranks on this host, groups {groups_desc}{limited}, "
          f"float32; latency = slowest rank's mean per call; busbw as nccl-tests", flush=True)
    return _launch(args, args.nproc, args.groups, base_argv)


class _Quota:
    """``--cpu-quota``: each group's ranks get its cores of CPU time (cgroup, or a SIGSTOP duty cycle)."""

    def __init__(self, quotas: List[float], run: str) -> None:
        from kaitian.launcher.runtimes.cpu_limits import CgroupQuota, DutyCycle, quota_mode

        self.quotas = quotas
        self.cgroups = CgroupQuota(run) if quota_mode(Settings.from_env().cpu_quota_mode) == "cgroup" else None
        self.duty = None if self.cgroups else DutyCycle()
        for g, cores in enumerate(quotas):
            if self.cgroups:
                self.cgroups.set_quota(f"cpu{g}", cores)

    def add(self, group: int, pid: int) -> None:
        if self.cgroups:
            self.cgroups.add(f"cpu{group}", pid)
        else:
            self.duty.add([pid], self.quotas[group])

    def remove(self) -> None:
        if self.cgroups:
            self.cgroups.remove()
        else:
            self.duty.release()


def _launch(args: argparse.Namespace, nproc: int, groups: int, worker_argv: List[str]) -> int:
    """Starts ``nproc`` ranks of this module (rank 0 prints) and waits for them."""
    workdir = tempfile.mkdtemp(prefix="kaitian-bench-")
    os.chmod(workdir, 0o700)
    port = _free_port()
    procs: List[subprocess.Popen] = []
    groups_desc = [f"cpu{_group_of(r, nproc, groups)}" for r in range(nproc)]
    quota = _Quota(args.quotas, f"bench.{os.getpid()}") if getattr(args, "quotas", None) else None
    try:
        for rank in range(nproc):
            # what kaitianrun --cpu-groups would give the rank (bench convention: torchrun's environment)
            kaitian = Settings.for_device(WorkerDevice("cpu", rank, groups_desc[rank]), run_dir=workdir,
                                          bridge=args.bridge or "auto", intra=args.intra or "auto")
            env = {**os.environ, **kaitian.to_env(), "OMP_NUM_THREADS": "1",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            cmd = [sys.executable, "-m", "kaitian.bench.collectives", *worker_argv, "--worker"]
            procs.append(subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else subprocess.DEVNULL,
                                          start_new_session=True))
            if quota:
                quota.add(_group_of(rank, nproc, groups), procs[-1].pid)
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        failed = [r for r, p in enumerate(procs) if p.poll() not in (0,)]
        if failed:
            print(f"kaitian bench collectives: rank(s) {failed} failed or timed out; stopping", file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        if quota:
            quota.remove()
        for p in procs:
            stop_session(p, grace_s=5)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
