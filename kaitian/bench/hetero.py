"""``kaitian bench hetero``: equal vs capability vs re-balanced split on two groups of different speed.

Two simulated vendor groups on this host's CPUs, one CPU slot each; kaitianrun
gives group ``cpu0`` ``--quota`` cores of CPU time and ``cpu1`` a third of that
(cgroup CPU quota), so cpu1 is really about 3x slower. In one run the bench
measures training throughput (samples/s, synthetic data, an MLP, backend
kaitian, kaitian.DistributedDataParallel) for:

* each group alone (its solo throughput; the *ideal* is their sum),
* the equal split (torch's behaviour),
* the static capability split (the solo throughputs as capabilities, what
  ``kaitian init`` would hand the sampler),
* online re-balancing (starting from the equal split).

Throughput is reported over the whole measured run (after one warm-up epoch)
and in steady state (the second half of the epochs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kaitian bench hetero", description=__doc__.splitlines()[0])
    p.add_argument("--quota", default="1,0.33",
                   help="CPU cores of time for groups cpu0,cpu1 (default 1,0.33: about 3:1)")
    p.add_argument("--batch-size", type=int, default=256, help="per-rank batch of the equal split")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--epochs", type=int, default=8, help="epochs per measurement (first is warm-up)")
    p.add_argument("--steps", type=int, default=6, help="steps per epoch")
    p.add_argument("--backend", default="kaitian")
    p.add_argument("--json", default=None, help="also write the results to this file")
    # internal: the training worker started by kaitianrun
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--capabilities", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


# -- worker (one per rank, started by kaitianrun) ---------------------------------------


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import kaitian

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = kaitian.device()
    kaitian.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    n = args.batch_size * world * args.steps
    g = torch.Generator().manual_seed(0)
    data = torch.randn(n, 256, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    dataset = list(range(n))
    caps = None
    if args.worker in ("equal", "rebalance"):
        caps = [1.0] * world
    elif args.worker == "static":
        caps = [float(c) for c in args.capabilities.split(",")]
    sampler = kaitian.DistributedSampler(dataset, args.batch_size, capabilities=caps, seed=0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 10),
    ).to(device)
    model = kaitian.DistributedDataParallel(net)
    if args.worker == "rebalance":
        kaitian.Rebalancer(sampler, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch_times: List[float] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        start = time.perf_counter()
        for idx in sampler.epoch_batches():
            x, y = data[idx].to(device), labels[idx].to(device)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        dist.barrier()
        epoch_times.append(time.perf_counter() - start)
    timings = list(model.step_timings)[len(model.step_timings) // 2:]
    own = [sum(t.compute_s for t in timings), sum(t.comm_s for t in timings),
           sum(t.samples for t in timings), len(timings)]
    everyone = [None] * world
    dist.all_gather_object(everyone, own)
    per_epoch = n  # every sample once per epoch (no padding: n divides evenly)
    measured = epoch_times[1:]
    steady = measured[len(measured) // 2:]
    result = {
        "mode": args.worker,
        "world": world,
        "samples_per_s": per_epoch * len(measured) / sum(measured),
        "steady_samples_per_s": per_epoch * len(steady) / sum(steady),
        "final_split": sampler.split,
        # second half of the run, per rank: compute seconds per sample, comm ms per step
        "compute_per_sample_ms": [1000 * c / max(1, k) for c, _, k, _ in everyone],
        "comm_ms_per_step": [1000 * m / max(1, st) for _, m, _, st in everyone],
    }
    if rank == 0 and args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    return 0


# -- driver -------------------------------------------------------------------------------


def _kaitianrun_cmd(launch: List[str], worker_args: List[str], out: str) -> List[str]:
    return [sys.executable, "-m", "kaitian.launcher.cli", *launch,
            "-m", "kaitian.bench.hetero", *worker_args, "--out", out]


def _collect(procs: List[tuple], timeout: float) -> List[dict]:
    """Waits for launched kaitianrun processes; returns their results in order."""
    results = []
    deadline = time.monotonic() + timeout
    try:
        for proc, cmd, out in procs:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0 or not os.path.exists(out):
                tail = (stdout + stderr)[-2500:]
                raise RuntimeError(f"kaitianrun failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
            with open(out, encoding="utf-8") as f:
                results.append(json.load(f))
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return results


def _run(jobs: List[tuple], timeout: float) -> List[dict]:
    """Starts kaitianrun jobs ``(launch, worker_args, out)`` at once and waits for all."""
    procs = []
    for launch, worker_args, out in jobs:
        cmd = _kaitianrun_cmd(launch, worker_args, out)
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True), cmd, out))
    return _collect(procs, timeout)


def _solo_pair(quotas, common, tmp, round_no, timeout) -> List[dict]:
    jobs = []
    for i, quota in enumerate(quotas):
        launch = ["--nproc-auto", "--cpu-slots", "2", "--devices", f"cpu:{i}",
                  "--cpu-quota", f"{quota:g}"]
        jobs.append((launch, ["--worker", "solo", *common],
                     os.path.join(tmp, f"solo{i}-{round_no}.json")))
    return _run(jobs, timeout)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``kaitian bench hetero``; returns 0, 1 if a run failed, 2 on bad arguments."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        return _worker(args)
    try:
        quotas = [float(q) for q in args.quota.split(",")]
    except ValueError:
        quotas = []
    if len(quotas) != 2 or min(quotas) <= 0:
        print("kaitian bench hetero: --quota needs two positive core counts, e.g. 1,0.33",
              file=sys.stderr)
        return 2
    if args.epochs < 3 or args.steps < 1 or args.batch_size < 2:
        print("kaitian bench hetero: need --epochs >= 3, --steps >= 1, --batch-size >= 2",
              file=sys.stderr)
        return 2
    common = ["--batch-size", str(args.batch_size), "--hidden", str(args.hidden),
              "--epochs", str(args.epochs), "--steps", str(args.steps), "--backend", args.backend]
    pair = ["--nproc-auto", "--cpu-slots", "2", "--cpu-groups", "2", "--cpu-quota", args.quota]
    timeout = 600.0
    print(f"kaitian bench hetero: groups cpu0 / cpu1 with {quotas[0]:g} / {quotas[1]:g} cores "
          f"of CPU time, MLP 256-{args.hidden}-{args.hidden}-10, per-rank batch "
          f"{args.batch_size} (global {2 * args.batch_size}), {args.epochs} epochs x "
          f"{args.steps} steps, backend {args.backend}", flush=True)
    results: Dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kaitian-bench-hetero-") as tmp:
        try:
            # Both groups alone at the same time (each on its own core), before and
            # after the pair runs: the mean cancels drift in the machine's load.
            before = _solo_pair(quotas, common, tmp, 0, timeout)
            for i, r in enumerate(before):
                print(f"  solo cpu{i} (before)      {r['steady_samples_per_s']:9.1f} samples/s", flush=True)
            caps = ",".join(f"{r['steady_samples_per_s']:.3f}" for r in before)
            for mode, label in [("equal", "equal split"), ("static", "static capability split"),
                                ("rebalance", "online re-balancing")]:
                extra = ["--capabilities", caps] if mode == "static" else []
                results[label] = _run([(pair, ["--worker", mode, *common, *extra],
                                        os.path.join(tmp, f"{mode}.json"))], timeout)[0]
                r = results[label]
                print(f"  {label:<24} {r['steady_samples_per_s']:9.1f} samples/s "
                      f"(whole run {r['samples_per_s']:.1f}), split {r['final_split']}", flush=True)
            after = _solo_pair(quotas, common, tmp, 1, timeout)
            for i, r in enumerate(after):
                print(f"  solo cpu{i} (after)       {r['steady_samples_per_s']:9.1f} samples/s", flush=True)
                results[f"solo cpu{i}"] = {
                    "steady_samples_per_s": (r["steady_samples_per_s"] + before[i]["steady_samples_per_s"]) / 2,
                    "before": before[i], "after": r,
                }
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"kaitian bench hetero: {exc}", file=sys.stderr)
            return 1
    ideal = results["solo cpu0"]["steady_samples_per_s"] + results["solo cpu1"]["steady_samples_per_s"]
    equal = results["equal split"]["steady_samples_per_s"]
    rows = [("mode", "samples/s", "% of ideal", "x equal")]
    for label in ("equal split", "static capability split", "online re-balancing"):
        v = results[label]["steady_samples_per_s"]
        rows.append((label, f"{v:.1f}", f"{100 * v / ideal:.1f}", f"{v / equal:.2f}"))
    rows.append(("ideal (sum of solos)", f"{ideal:.1f}", "100.0", f"{ideal / equal:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print()
    for r in rows:
        print("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    reb = results["online re-balancing"]["steady_samples_per_s"]
    ok = reb >= 0.9 * ideal and reb >= 1.4 * equal
    print(f"\ngoal (re-balancing >= 90 % of ideal and >= 1.4x equal): {'met' if ok else 'NOT met'} "
          f"({100 * reb / ideal:.1f} % of ideal, {reb / equal:.2f}x equal)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"results": results, "ideal": ideal}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
