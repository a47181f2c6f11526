"""``kaitian bench hetero``: a heterogeneous job against its fastest group alone and the ideal.

Two simulated vendor groups on this host's CPUs, one CPU slot (core) each;
kaitianrun gives group ``cpu0`` ``--quota`` cores of CPU time and ``cpu1``
less (default ``0.3,0.1``: a cgroup CPU quota, so cpu1 is really 3x slower;
``--gap G`` makes cpu1's quota cpu0's over G; quotas well below a core keep
the ratio even when other processes load the machine). One kaitianrun job
(backend kaitian) trains an MLP on synthetic data and cycles through its
phases, one epoch each, so that changes in the machine's load hit every
mode alike: the equal split, the static split and ``--pairs`` epochs each of
the fastest group alone, re-balancing, a plain local model and solo, in turn
(A B C D A B C D; the first cycle starts with a solo epoch that measures the
ranks). The three parts rotate through their positions from cycle to cycle:
on a virtual machine the phase after the equal split's, in which the fast
rank mostly waits, runs measurably faster, and a fixed order would hand that
to one mode. The modes:

* *solo*: each rank trains a local copy alone at its equal-split batch (both
  at once, no communication),
* *fastest group alone*: the fastest group (by the first solo epoch's
  throughput) trains the whole global batch by itself with the same code, a
  one-rank job (kaitian's DDP, sampler and Rebalancer), the others idle: what
  the user's script gives with the other devices left out (``USE_CPU=-1``),
* *plain local model*: the same rank trains the whole global batch as a plain
  local model (no DDP): the floor under any distributed job, reported beside
  the goal,
* *equal split* (torch's behaviour) with kaitian.DistributedDataParallel,
* *static capability split*: the first solo epoch's throughputs as
  capabilities (what ``kaitian init`` under the same conditions would give),
* *online re-balancing*: starts equal; its Rebalancer (default settings, and
  the optimizer: a rank that does not pay is benched) re-splits within its
  epochs and keeps its state across cycles.

The *ideal* is the best subset's solo throughput: the sum of the solos (every
rank, each at its equal-split batch) or the plain local model (the fastest
rank alone at the whole batch), whichever is higher.

No synchronised job reaches the sum of the solos on a machine whose step times
vary: each of its steps lasts as long as its slowest rank's, and solo ranks
never wait for one another. The *lock-step share* says how much of it one can
reach at the variation measured: from each solo epoch's step times, a job with
every rank's share in proportion to its speed and no overhead at all would keep
``1 / E[max_r t_r / mean(t_r)]`` of the solos' sum (every combination of the
ranks' steps in the epoch equally likely). On this 2-core VM one process alone
on an idle core varied its step by 8-16 % (the same batch, the same weights);
two default runs' shares were 96.7 and 96.5 % (2026-12-06). Re-balancing is
also reported against it: an estimate from a few steps, not a bound.

A phase's time is its training ranks' (the slowest one's, from its epoch
start, the re-balancer's round included, to its last step): a benched rank
receives its copy of the state at the epoch's end, which holds up only
collectives of the whole world, not the steps.

The table reports each mode's median over the second half of the cycles (the
steady state: re-balancing starts from the equal split by design; a median,
because a transient stall of one rank on a shared machine hits one phase and
a mean would charge it to whichever mode it hit), and re-balancing's mean
over all cycles, convergence included. The goal's numbers are paired:
re-balancing's factor over the fastest group alone (over the plain local
model) is the median of each re-balancing epoch over the alone (local) epoch
of its turn, and its share of the ideal the median over the higher of its
turn's solo and plain local epochs: a virtual machine's speed drifts by
10-20 % within seconds, more than the difference the goal is about, and
epochs run back to back see the same.

Every mode's model on a rank trains the same parameter tensors (each mode its
own module, DDP and optimizer around them): where a weight is about as large as
a core's cache (here 4 MB, as the 1024 x 1024 layer), the memory a model's
weights happen to get makes it faster or slower for the whole run. Six copies
of the plain local model, trained in turn on one core of this 2-core VM, kept
medians 4-8 % apart for a whole run; sharing the weights brought that to 2-3 %,
the machine's noise. Separate copies would hand that to whichever mode got the
better memory.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from kaitian.bench.session import stop_session

__all__ = ["main"]

_MODES = ("solo", "alone", "local", "equal", "static", "rebalance")
_PARALLEL = _MODES[1:]
_TURN = ("alone", "rebalance", "local", "solo")  # compared epoch by epoch: one of each per turn
_PROGRESS = "kaitian bench hetero: cycle "  # the worker's progress lines, passed through by the driver
_LABELS = {
    "alone": "fastest group alone",
    "local": "plain local model",
    "equal": "equal split",
    "static": "static capability split",
    "rebalance": "online re-balancing",
}


def _phases(cycle: int, pairs: int) -> List[str]:
    """The equal split, the static split and ``pairs`` turns of the fastest group alone,
    re-balancing, the plain local model and solo (which of them leads rotates each cycle);
    the three parts rotate by one position each cycle. The first cycle starts by measuring
    the ranks (``capabilities``: a solo epoch, for the static split and the fastest rank)."""
    lead = cycle % len(_TURN)
    turn = [*_TURN[lead:], *_TURN[:lead]]
    parts = [["equal"], ["static"], turn * pairs]
    k = cycle % len(parts)
    return ["capabilities"] * (cycle == 0) + [mode for part in parts[k:] + parts[:k] for mode in part]


def _steady_state(history: Dict[str, List[Tuple[int, float]]],
                  cycles: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Each mode's median samples/s over the second half of the cycles, and re-balancing's paired
    factors: the median of each re-balancing epoch over the alone (local) epoch of its turn (the k-th
    of each in a cycle), over its turn's ideal, the higher of its solo and local epochs, and over what
    a lock-step job can reach of that ideal (its solo epoch's ``lockstep`` share of the solos' sum);
    and that share's median."""
    settled = cycles // 2
    steady = {m: statistics.median(v for c, v in runs if c >= settled) for m, runs in history.items()}
    turns = [(r, a, lo, so, ls) for (c, r), (_, a), (_, lo), (_, so), (_, ls)
             in zip(*(history[m] for m in ("rebalance", "alone", "local", "solo", "lockstep"))) if c >= settled]
    paired = {
        "alone": statistics.median(r / a for r, a, _, _, _ in turns),
        "local": statistics.median(r / lo for r, _, lo, _, _ in turns),
        "ideal": statistics.median(r / max(lo, so) for r, _, lo, so, _ in turns),
        "lockstep": statistics.median(r / max(lo, so * ls) for r, _, lo, so, ls in turns),
        "lockstep_share": statistics.median(ls for _, _, _, _, ls in turns),
    }
    return steady, paired


def lockstep_share(step_times: Sequence[Sequence[float]]) -> float:
    """The share of the ranks' summed solo throughput that a synchronised job with no overhead keeps
    when each rank's steps vary as ``step_times`` (each rank's, at one batch): every rank's share
    of the batch in proportion to its mean speed, a step as long as its slowest rank's, every
    combination of the ranks' steps equally likely: ``1 / E[max_r t_r / mean(t_r)]``."""
    relative = [[t * len(times) / sum(times) for t in times] for times in step_times]
    return 1.0 / statistics.mean(max(combo) for combo in itertools.product(*relative))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kaitian bench hetero", description=__doc__.splitlines()[0])
    p.add_argument("--quota", default="0.3,0.1",
                   help="CPU cores of time for groups cpu0,cpu1 (default 0.3,0.1: 3:1, low enough "
                   "that the quota, not other load on the machine, sets each group's speed)")
    p.add_argument("--gap", type=float, default=None,
                   help="cpu1 gets cpu0's quota over this; with one --quota value (e.g. --quota 1 --gap 10: 1,0.1)")
    p.add_argument("--batch-size", type=int, default=2048,
                   help="per-rank batch of the equal split (default 2048: the quota slows a "
                   "rank's per-step host work - DDP bookkeeping, gradient copies, optimizer - "
                   "as much as its compute, which a real accelerator's host does not)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--features", type=int, default=256,
                   help="input width of the MLP (64: the shape of examples/train_digits.py)")
    p.add_argument("--cycles", type=int, default=8,
                   help="cycles of the phases (the second half is the steady state; a multiple of 12 "
                   "gives each part each position, and each mode of a turn the lead, equally often)")
    p.add_argument("--steps", type=int, default=4, help="steps per phase (one epoch)")
    p.add_argument("--pairs", type=int, default=4,
                   help="turns per cycle: an epoch each of the fastest group alone, re-balancing, "
                   "the plain local model and solo, back to back; re-balancing is compared turn by turn")
    p.add_argument("--backend", default="kaitian")
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds before the job is stopped (default 3600: the default run takes 10-30 min, "
                   "by the host's speed)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


# -- worker (one per rank, started by kaitianrun) ---------------------------------------


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import kaitian
    from kaitian.training.exchange import gather_per_rank

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = kaitian.device()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    n = args.batch_size * world * args.steps
    g = torch.Generator().manual_seed(0)
    data = torch.randn(n, args.features, generator=g).to(device)
    labels = torch.randint(0, 10, (n,), generator=g).to(device)
    dataset = list(range(n))

    weights: List[torch.Tensor] = []  # every mode's model trains these (see the module's docstring)

    def make_net():
        kaitian.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
            torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
            torch.nn.Linear(args.hidden, 10),
        ).to(device)
        if not weights:
            weights.extend(p.data for p in net.parameters())
        for p, w in zip(net.parameters(), weights):
            p.data = w
        return net

    def gather(value: float) -> List[float]:
        return [row[0] for row in gather_per_rank([value], device=device)]

    def shuffled(cycle: int, size: int) -> List[List[int]]:
        """The epoch's batches of ``size`` for a local model: a permutation seeded by the cycle."""
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cycle)).tolist()
        return [perm[i * size:(i + 1) * size] for i in range(args.steps)]

    def train(model, opt, batches, step_times: Optional[List[float]] = None) -> int:
        seen = 0
        for idx in batches:
            begun = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(data[idx]), labels[idx]).backward()
            opt.step()
            seen += len(idx)
            if step_times is not None:
                step_times.append(time.perf_counter() - begun)
        return seen

    solo_net = make_net()
    solo_opt = torch.optim.SGD(solo_net.parameters(), lr=0.01)
    runs = {}
    for mode in ("equal", "rebalance"):
        sampler = kaitian.DistributedSampler(dataset, batch_size=args.batch_size, capabilities=[1.0] * world)
        model = kaitian.DistributedDataParallel(make_net(), sampler=sampler)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if mode == "rebalance":
            balancer = kaitian.Rebalancer(sampler, model, optimizer=opt)
        runs[mode] = (sampler, model, opt)
    local_net = make_net()
    local_opt = torch.optim.SGD(local_net.parameters(), lr=0.01)
    alone_job = None  # (sampler, model, opt) of the fastest rank's one-rank job, made when first needed

    def alone_epoch(fastest: int) -> int:
        """An epoch of the fastest rank's one-rank job: the same code on its own group, as the
        script run with only that group's devices (``USE_CPU=-1``) would train."""
        nonlocal alone_job
        if alone_job is None:
            group = dist.new_group([fastest], use_local_synchronization=True)
            sampler = kaitian.DistributedSampler(dataset, batch_size=args.batch_size * world, group=group)
            model = kaitian.DistributedDataParallel(make_net(), sampler=sampler, process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            kaitian.Rebalancer(sampler, model, optimizer=opt, group=group)
            alone_job = (sampler, model, opt)
        sampler, model, opt = alone_job
        sampler.set_epoch(sampler.epoch + 1)
        return train(model, opt, sampler.epoch_batches())

    # (cycle, samples/s) of every phase; "lockstep": (cycle, lockstep_share) of each solo epoch
    history = {m: [] for m in (*_MODES, "lockstep")}
    solo_rates: List[float] = []
    fastest = 0  # the rank the alone and plain local modes train on, by its solo rate
    epoch = 0
    for cycle in range(args.cycles):
        for mode in _phases(cycle, args.pairs):
            if mode == "static" and "static" not in runs:
                sampler = kaitian.DistributedSampler(dataset, batch_size=args.batch_size, capabilities=solo_rates)
                model = kaitian.DistributedDataParallel(make_net(), sampler=sampler)
                runs["static"] = (sampler, model, torch.optim.SGD(model.parameters(), lr=0.01))
            dist.barrier()
            start = time.perf_counter()
            if mode in ("capabilities", "solo"):
                step_times: List[float] = []
                seen = train(solo_net, solo_opt, shuffled(cycle, args.batch_size), step_times)
                rates = gather(seen / (time.perf_counter() - start))
                if mode == "capabilities":
                    solo_rates = rates
                    fastest = max(range(world), key=lambda r: (rates[r], -r))
                else:
                    history["solo"].append((cycle, sum(rates)))
                    history["lockstep"].append((cycle, lockstep_share(gather_per_rank(step_times, device=device))))
                continue
            if mode in ("alone", "local"):
                rate = 0.0
                if rank == fastest:
                    if mode == "alone":
                        seen = alone_epoch(fastest)
                    else:
                        seen = train(local_net, local_opt, shuffled(cycle, args.batch_size * world))
                    rate = seen / (time.perf_counter() - start)
                history[mode].append((cycle, sum(gather(rate))))
                continue
            sampler, model, opt = runs[mode]
            sampler.set_epoch(epoch)  # the re-balancer's round happens here: timed, the user waits for it too
            epoch += 1
            seen = train(model, opt, sampler.epoch_batches())
            # the training ranks' time: a benched rank's copy of the state at the epoch's end
            # holds up only collectives of the whole world (as the gathers here), not the steps
            elapsed = max(gather(time.perf_counter() - start if seen else 0.0))
            history[mode].append((cycle, sum(gather(seen)) / elapsed))
        if rank == 0:
            print(f"{_PROGRESS}{cycle + 1}/{args.cycles} done", flush=True)

    steady, paired = _steady_state(history, args.cycles)
    result = {
        "world": world,
        "capabilities": solo_rates,
        "history": history,
        "steady": steady,
        "rebalance_all_cycles": statistics.mean(v for _, v in history["rebalance"]),
        "rebalance_paired": paired,
        "splits": {m: runs[m][0].split for m in runs},
        "timings": {m: [[t.samples, t.compute_s, t.comm_s, t.step_s] for t in runs[m][1].step_timings][-8:]
                    for m in runs},
    }
    if rank == 0 and args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
    if args.out:  # the rounds this rank trained in (a spare's history only follows the trainers')
        with open(f"{args.out}.rounds.{rank}", "w", encoding="utf-8") as f:
            json.dump([[d.epoch, d.old, d.fixed_s, d.per_sample_s, d.exchange_s, d.new, d.predicted_s,
                        d.measured_s, d.stripes] for d in balancer.history if d.per_sample_s], f)
    del runs, model, opt, sampler, alone_job
    gc.collect()
    dist.destroy_process_group()
    return 0


# -- driver -------------------------------------------------------------------------------


def _run_job(cmd: List[str], timeout: float) -> Tuple[Optional[int], str]:
    """Runs the job, passing its progress lines through: its exit code (``None``: it ran past
    ``timeout`` and was stopped, every process of it) and its whole output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: List[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if _PROGRESS in line:
                print(line[line.index(_PROGRESS):], end="", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode: Optional[int] = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_session(proc, grace_s=60)
        returncode = None
    except BaseException:  # Ctrl-C: the job runs in its own session, out of the terminal's reach
        stop_session(proc, grace_s=60)
        raise
    reader.join()
    return returncode, "".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``kaitian bench hetero``; returns 0, 1 if the run failed, 2 on bad arguments."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        return _worker(args)
    try:
        quotas = [float(q) for q in args.quota.split(",")]
    except ValueError:
        quotas = []
    if args.gap is not None:
        if len(quotas) != 1 or not args.gap >= 1:  # (beside two values it would be ignored)
            print("kaitian bench hetero: --gap G divides one --quota value (cpu0's cores), G >= 1, "
                  "e.g. --quota 1 --gap 10", file=sys.stderr)
            return 2
        quotas.append(quotas[0] / args.gap)
    if len(quotas) != 2 or min(quotas) <= 0:
        print("kaitian bench hetero: --quota needs two positive core counts, e.g. 0.3,0.1 "
              "(or one and --gap >= 1, e.g. --quota 1 --gap 10)", file=sys.stderr)
        return 2
    if (args.cycles < 2 or args.steps < 1 or args.batch_size < 2 or args.features < 1 or args.pairs < 1
            or not args.timeout > 0):
        print("kaitian bench hetero: need --cycles >= 2, --steps >= 1, --batch-size >= 2, --features >= 1, "
              "--pairs >= 1, --timeout > 0", file=sys.stderr)
        return 2
    quota = ",".join(f"{q:g}" for q in quotas)
    print(f"kaitian bench hetero: groups cpu0 / cpu1 with {quotas[0]:g} / {quotas[1]:g} cores "
          f"of CPU time, MLP {args.features}-{args.hidden}-{args.hidden}-10, per-rank batch "
          f"{args.batch_size} (global {2 * args.batch_size}), {args.cycles} cycles of equal, static and "
          f"{args.pairs} x (alone, re-balancing, plain local, solo) epochs of {args.steps} steps, "
          f"backend {args.backend}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kaitian-bench-hetero-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-auto", "--cpu-slots", "2",
               "--cpu-groups", "2", "--cpu-quota", quota, "-m", "kaitian.bench.hetero",
               "--worker", "--batch-size", str(args.batch_size), "--hidden", str(args.hidden),
               "--features", str(args.features), "--cycles", str(args.cycles), "--steps", str(args.steps),
               "--pairs", str(args.pairs),
               "--backend", args.backend, "--out", out]
        returncode, output = _run_job(cmd, args.timeout)
        if returncode is None:
            print(f"kaitian bench hetero: the benchmark job ran past --timeout {args.timeout:g} s; stopped it:\n"
                  f"{output[-3000:]}", file=sys.stderr)
            return 1
        if returncode != 0 or not os.path.exists(out):
            print(f"kaitian bench hetero: kaitianrun failed ({returncode}):\n{output[-3000:]}", file=sys.stderr)
            return 1
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
        rounds: Dict[str, list] = {}  # every rank's (the same round on each of its trainers: once)
        for r in range(result["world"]):
            with open(f"{out}.rounds.{r}", encoding="utf-8") as f:
                rounds.update((json.dumps(entry), entry) for entry in json.load(f))
        result["rebalance_rounds"] = sorted(rounds.values(), key=lambda entry: entry[0])
    steady = result["steady"]
    # the best subset's solo throughput: every rank's own (at the equal split's batch) or the fastest's alone
    # (at the whole batch: where fixed costs dominate, one rank at twice the batch beats both at half)
    ideal, equal, alone = max(steady["solo"], steady["local"]), steady["equal"], steady["alone"]
    solo = result["capabilities"]
    print(f"solo throughput (measured first): cpu0 {solo[0]:.1f}, cpu1 {solo[1]:.1f} samples/s "
          f"(ratio {solo[0] / solo[1]:.2f}:1)")
    for mode in _PARALLEL:
        split = f"   final split {result['splits'][mode]}" if mode in result["splits"] else ""
        per_cycle = [statistics.median(v for c, v in result["history"][mode] if c == cycle)
                     for cycle in range(args.cycles)]
        print(f"  {_LABELS[mode]:<24} per cycle: " + ", ".join(f"{v:.0f}" for v in per_cycle) + split)
    rows = [("mode", "samples/s", "% of ideal", "x alone", "x equal")]
    for mode in _PARALLEL:
        v = steady[mode]
        rows.append((_LABELS[mode], f"{v:.1f}", f"{100 * v / ideal:.1f}", f"{v / alone:.2f}", f"{v / equal:.2f}"))
    reb_all = result["rebalance_all_cycles"]
    rows.append(("re-balancing, all (mean)", f"{reb_all:.1f}", f"{100 * reb_all / ideal:.1f}",
                 f"{reb_all / alone:.2f}", f"{reb_all / equal:.2f}"))
    rows.append(("ideal (best subset)", f"{ideal:.1f}", "100.0", f"{ideal / alone:.2f}", f"{ideal / equal:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for r in rows:
        print("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    reb, paired = steady["rebalance"], result["rebalance_paired"]
    met = paired["alone"] >= 1.0 and paired["ideal"] >= 0.95
    print(f"\nre-balancing: {100 * paired['ideal']:.1f} % of ideal, {paired['alone']:.3f}x the fastest group "
          f"alone ({paired['local']:.3f}x its plain local model; medians of each re-balancing epoch over its "
          f"turn's ideal and alone and local epochs), {reb / equal:.2f}x equal (medians over the steady state, "
          f"cycles {args.cycles // 2 + 1}..{args.cycles}); goal: >= 1.0x alone and >= 95 % of ideal: "
          f"{'met' if met else 'NOT met'}")
    print(f"lock-step share: the solo epochs' steps vary enough that a synchronised job with no overhead would "
          f"keep about {100 * paired['lockstep_share']:.1f} % of the solos' sum (an estimate from {args.steps} "
          f"steps a rank an epoch); re-balancing reached {100 * paired['lockstep']:.1f} % of that share of each "
          f"turn's ideal")
    rounds = result["rebalance_rounds"]
    print(f"re-balancing rounds, the first 6 of {len(rounds)} (fixed s, per-sample s, exchange s, split, "
          "stripe weights, predicted / measured step ms): "
          + "; ".join(f"{[round(a, 4) for a in f]} {[round(b, 6) for b in p]} {x:.4f} {n} {w or 'even'} "
                      f"{1e3 * t:.3g} / {1e3 * m:.3g}" for _, _, f, p, x, n, t, m, w in rounds[:6]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
