"""``kaitian bench recovery``: a lost worker under ``--on-failure continue`` vs a restart, in one run.

The same training job (an MLP on synthetic data, backend kaitian, the global
batch cut over ``--nproc`` workers in two simulated vendor groups) runs under

* ``kaitianrun --on-failure continue`` (:class:`kaitian.elastic.Trainer`):
  the survivors re-form and redo the step in flight; the killed worker is
  restarted and rejoins;
* ``kaitianrun --on-failure restart`` and ``torchrun`` (``--max-restarts 1``):
  every worker is stopped and started again, and the script resumes from
  its checkpoint, saved every ``--checkpoint-every`` steps (model, optimizer,
  sampler).

Runs are interleaved (``--repeats`` each, medians reported). In each, once
``--kill-at`` steps are applied the benchmark SIGKILLs the worker of launch
rank 1, and reads every worker's step log afterwards:

* kill -> next step: until the job after the loss (the next generation of
  members, or the restarted workers) completes a step;
* kill -> step in flight done: until it completes the step that was in
  flight at the kill (progress regained);
* steps redone: the step in flight (its work is discarded) plus every step
  that completed before the kill and again after it;
* samples lost: samples of the epochs' global batches never trained.

With ``--device cuda`` (or ``mlu``, the fake one) the job is device 0's
worker beside one CPU worker, and the device's worker is the one killed:

* kill -> rejoined: until the restarted worker completes its first step
  (continue mode), with where that time went: the process's start, torch
  and kaitian's imports, its device ready, admitted with the state sent to
  it, its first step. The job is stopped there (samples lost: not counted),
  so ``--epochs`` only needs to outlast the rejoin.

Target: under continue, the next step within 5 s of the kill, one step
redone, no sample lost (a device: the worker rejoined).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from kaitian.bench import BenchParser
from kaitian.bench.session import stop_session

__all__ = ["main"]

_MODES = {
    "continue": ("kaitianrun", ["--on-failure", "continue"]),
    "restart": ("kaitianrun", ["--on-failure", "restart"]),
    "torchrun": ("torchrun", []),
}
_LABELS = {"continue": "kaitianrun --on-failure continue", "restart": "kaitianrun --on-failure restart",
           "torchrun": "torchrun (checkpoint + restart)"}
_TARGET_S = 5.0


# -- the worker --------------------------------------------------------------------------------


def _model_and_data(args):
    import torch

    g = torch.Generator().manual_seed(0)
    n = args.samples
    x = torch.randn(n, args.width, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    torch.manual_seed(1234)
    net = torch.nn.Sequential(torch.nn.Linear(args.width, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, 10))
    return net, torch.utils.data.TensorDataset(x, y, torch.arange(n))


def _log(args, name: str, record: dict) -> None:
    with open(os.path.join(args.out, f"{name}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _worker(args) -> int:
    import torch
    import torch.nn.functional as F

    import kaitian
    from kaitian.settings import settings

    imported = time.time()
    launch_rank = int(os.environ["RANK"])
    attempt = (settings().elastic_id or "").replace("/", "_").replace(":", "_") or \
        f"{launch_rank}_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    with open(os.path.join(args.out, f"pid.{launch_rank}.{attempt}"), "w") as f:
        f.write(str(os.getpid()))
    net, data = _model_and_data(args)
    device = kaitian.set_device() if args.device != "cpu" else torch.device("cpu")
    net.to(device)
    torch.zeros(1, device=device).cpu()  # the device's context is made
    # where a restarted worker's time goes before it trains (its first step's record adds the join)
    _log(args, f"start.{attempt}", {"launch_rank": launch_rank, "device": device.type, "pid": os.getpid(),
                                    "started": _process_start(), "imported": imported, "device_ready": time.time()})
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    log = f"steps.{attempt}"

    def step_fn(model, batch):
        x, y, _ = batch
        return F.cross_entropy(model(x), y)

    if args.worker == "continue":
        from kaitian.elastic import Trainer

        trainer = Trainer(net, opt, data, batch_size=args.batch_size, timeout=30, quorum_timeout=10)
        def on_event(event):
            if event.kind == "joined":
                _log(args, f"start.{attempt}", {"joined": event.time})

        _log(args, f"start.{attempt}", {"trainer_ready": time.time()})  # the optimizer imports torch._dynamo
        trainer.fit(step_fn, args.epochs, on_event=on_event, on_step=lambda info: _log(
            args, log, {"applied": info.applied, "time": time.time(), "life": info.generation, "who": attempt}))
        trainer.close()
        return 0
    return _checkpointed_loop(args, net, opt, data, step_fn, log, int(os.environ["TORCHELASTIC_RESTART_COUNT"]))


def _process_start() -> float:
    """When this process started (wall clock): the exec, before Python's own imports."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def _checkpointed_loop(args, net, opt, data, step_fn, log, life: int) -> int:
    """The restart modes: kaitian's sampler and DDP, a checkpoint every N steps, resumed after a restart."""
    import torch
    import torch.distributed as dist

    import kaitian

    dist.init_process_group("kaitian")
    sampler = kaitian.DistributedSampler(data, batch_size=args.batch_size)
    model = kaitian.DistributedDataParallel(net, sampler=sampler)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler.batch_sampler())
    path = os.path.join(args.out, "checkpoint.pt")
    applied = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        applied = state["applied"]
    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            opt.zero_grad()
            step_fn(model, batch).backward()
            opt.step()
            applied += 1
            _log(args, log, {"applied": applied, "time": time.time(), "life": life})
            if applied % args.checkpoint_every == 0:
                if dist.get_rank() == 0:
                    state = {"model": net.state_dict(), "optimizer": opt.state_dict(),
                             "sampler": sampler.state_dict(), "applied": applied}
                    torch.save(state, path + ".tmp")
                    os.replace(path + ".tmp", path)
                dist.barrier()
    del model, loader
    dist.destroy_process_group()
    return 0


# -- the benchmark ----------------------------------------------------------------------------------


def _command(mode: str, args, out: str) -> List[str]:
    launcher, flags = _MODES[mode]
    worker = ["-m", "kaitian.bench.recovery", "--worker", "continue" if mode == "continue" else "restart",
              "--out", out, *_shared_flags(args)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(args.nproc), "--max-restarts", "1", *worker]
    # a device: its worker and CPU workers in their own group (the device's vendor selects them)
    workers = ["--nproc-auto"] if args.device != "cpu" else ["--nproc-per-node", str(args.nproc), "--cpu-groups", "2"]
    return [sys.executable, "-m", "kaitian.launcher.cli", "--standalone", *workers, "--max-restarts", "1", *flags,
            *worker]


def _shared_flags(args) -> List[str]:
    return ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--samples", str(args.samples),
            "--width", str(args.width), "--hidden", str(args.hidden), "--checkpoint-every",
            str(args.checkpoint_every), "--device", args.device]


def _env(mode: str, args) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("USE_")}
    if args.device != "cpu":  # device 0 and CPU slot 0
        env.update({f"USE_{v.upper()}": "0" if v == args.device else "-1" for v in ("cuda", "mlu")}, USE_CPU="0")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if mode == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # torchrun 2.13 hangs on a restart without it
    return env


def _steps(out: str) -> List[dict]:
    found = []
    for path in glob.glob(os.path.join(out, "steps.*.jsonl")):
        with open(path) as f:
            found += [json.loads(line) for line in f if line.strip()]
    return sorted(found, key=lambda r: r["time"])


def _one(mode: str, args) -> dict:
    """One run: start, kill launch rank 1 once ``--kill-at`` steps are applied, measure."""
    with tempfile.TemporaryDirectory(prefix="kaitian-bench-recovery-") as out:
        log_path = os.path.join(out, "job.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(_command(mode, args, out), env=_env(mode, args), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + args.timeout
            while max((r["applied"] for r in _steps(out)), default=0) < args.kill_at:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: the job ended or stalled before step {args.kill_at}"
                                       f"{_output_end(log_path)}")
                time.sleep(0.002)
            (victim,) = _starts(out, _victim_rank(out, args))
            killed = time.time()
            os.kill(victim["pid"], signal.SIGKILL)

            def rejoin() -> dict:
                return _rejoin([s for s in _starts(out, victim["launch_rank"]) if s["pid"] != victim["pid"]],
                               _steps(out), killed)

            if args.device != "cpu":  # the job ends once the device's worker trained again: its rejoin
                while rejoin()["rejoin_s"] is None and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                stop_session(proc)
                return {**_measure(_steps(out), killed, args, complete=False), **rejoin()}
            code = proc.wait(timeout=args.timeout)
            if code != 0:
                raise RuntimeError(f"{mode}: the job failed after the kill (exit code {code}){_output_end(log_path)}")
            return {**_measure(_steps(out), killed, args), **rejoin()}
        finally:
            stop_session(proc)


def _output_end(log_path: str) -> str:
    """The end of the job's output, for an error (its folder goes with the run)."""
    with open(log_path, errors="replace") as log:
        return "; its output ended:\n" + log.read()[-3000:]


def _starts(out: str, launch_rank: int) -> List[dict]:
    """The start records of launch rank ``launch_rank``'s workers (one per start), each merged into one dict."""
    found = []
    for path in glob.glob(os.path.join(out, "start.*.jsonl")):
        record: dict = {"who": os.path.basename(path)[len("start."):-len(".jsonl")]}
        with open(path) as f:
            for line in f:
                record.update(json.loads(line))
        if record.get("launch_rank") == launch_rank:
            found.append(record)
    return found


def _victim_rank(out: str, args) -> int:
    """The worker to kill: the device's (``--device``), else launch rank 1."""
    if args.device == "cpu":
        return 1
    return next(r for r in range(args.nproc) for s in _starts(out, r) if s["device"] == args.device)


def _rejoin(restarted: List[dict], steps: List[dict], killed: float) -> dict:
    """Kill -> the restarted worker's first step (``None``: it never trained), and where the time went."""
    if not restarted:
        return {"rejoin_s": None, "rejoin_parts": {}}
    start = min(restarted, key=lambda s: s["started"])
    first = next((r["time"] for r in steps if r.get("who") == start["who"]), None)
    marks = [("process started", start["started"]), ("torch and kaitian imported", start["imported"]),
             ("device ready", start["device_ready"]), ("optimizer and trainer built", start.get("trainer_ready")),
             ("admitted, state received", start.get("joined")),
             ("first step", first)]
    parts, last = {}, killed
    for name, at in marks:
        if at is not None:
            parts[name], last = at - last, at
    return {"rejoin_s": None if first is None else first - killed, "rejoin_parts": parts}


def _measure(steps: List[dict], killed: float, args, complete: bool = True) -> dict:
    """The recovery of one run from every worker's step log (``life``: generation or restart count);
    samples lost only if the job ran to its end (``complete``), else ``None``."""
    before = [r for r in steps if r["time"] <= killed]
    in_flight = max(r["applied"] for r in before) + 1
    life = max(r["life"] for r in before)
    recovered = [r for r in steps if r["life"] > life]
    trained = {r["applied"] for r in steps}
    full, rest = divmod(args.samples, args.batch_size * args.nproc)
    per_epoch = full + (1 if rest else 0)
    missing = [a for a in range(1, per_epoch * args.epochs + 1) if a not in trained]
    batch = args.batch_size * args.nproc
    return {
        "next_s": recovered[0]["time"] - killed,
        "back_s": next(r["time"] for r in recovered if r["applied"] >= in_flight) - killed,
        "redone": 1 + len({r["applied"] for r in recovered if r["applied"] < in_flight}),
        "samples_lost": sum(batch if (a - 1) % per_epoch < full else rest for a in missing) if complete else None,
    }


def _seconds(value: Optional[float]) -> str:
    return "never" if value is None else f"{value:.2f} s"


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the benchmark and prints a table; returns 0 (1 if a target is missed with --check)."""
    parser = BenchParser(prog="kaitian bench recovery", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=("continue", "restart"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--modes", default="continue,restart,torchrun", help="which modes to run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (interleaved)")
    parser.add_argument("--nproc", type=int, default=3, help="workers (two simulated vendor groups)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=7680, help="dataset size")
    parser.add_argument("--batch-size", type=int, default=64, help="per-rank batch of an equal split")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="restart modes: steps per checkpoint")
    parser.add_argument("--kill-at", type=int, default=15, help="kill once this many steps are applied")
    parser.add_argument("--device", choices=("cpu", "cuda", "mlu"), default="cpu",
                        help="cuda or mlu: device 0's worker (the one killed) beside one CPU worker "
                             "(default cpu: --nproc workers in two simulated vendor groups)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--check", action="store_true", help="exit 1 if continue misses its target")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    if min(args.repeats, args.epochs, args.samples, args.batch_size, args.width, args.hidden,
           args.checkpoint_every, args.kill_at) < 1 or not args.timeout > 0:
        parser.error("need --repeats, --epochs, --samples, --batch-size, --width, --hidden, --checkpoint-every "
                     "and --kill-at >= 1, --timeout > 0")
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(_MODES))
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(_MODES)}")
    if args.device != "cpu":
        if "torchrun" in modes:
            parser.error("--device: torchrun has no device selection of kaitian's; use --modes continue,restart")
        args.nproc = 2  # the device's worker and one CPU worker (one CPU slot)
    elif args.nproc < 2:
        parser.error(f"--nproc {args.nproc}: two simulated vendor groups need at least 2 workers")
    steps = -(-args.samples // (args.batch_size * args.nproc)) * args.epochs
    if args.kill_at >= steps:
        parser.error(f"--kill-at {args.kill_at}: the job has {steps} steps; kill before its last")
    results: Dict[str, List[dict]] = {m: [] for m in modes}
    for i in range(args.repeats):
        for mode in (modes if i % 2 == 0 else list(reversed(modes))):
            r = _one(mode, args)
            results[mode].append(r)
            print(f"  {mode:<9} run {i + 1}: kill -> next step {r['next_s']:.2f} s, -> step in flight done "
                  f"{r['back_s']:.2f} s, steps redone {r['redone']}, samples lost {r['samples_lost']}"
                  + (f", -> rejoined {_seconds(r['rejoin_s'])} ("
                     + ", ".join(f"{k} +{v:.2f} s" for k, v in r["rejoin_parts"].items()) + ")"
                     if mode == "continue" else ""), flush=True)
    print()
    victim = f"the {args.device} worker" if args.device != "cpu" else "worker 1"
    print(f"kaitian bench recovery: {args.nproc} workers, batch {args.batch_size} per rank, MLP "
          f"{args.width}-{args.hidden}-{args.hidden}-10, {victim} SIGKILLed after {args.kill_at} steps, "
          f"checkpoint every {args.checkpoint_every} steps (restart modes); medians of {args.repeats} runs")
    print(f"{'mode':<36}{'kill->next step':>17}{'kill->in-flight done':>22}{'steps redone':>14}"
          f"{'samples lost':>14}{'kill->rejoined':>16}")
    medians = {}
    for mode in modes:
        rows = results[mode]
        med = {k: None if any(r[k] is None for r in rows) else statistics.median(r[k] for r in rows)
               for k in ("next_s", "back_s", "redone", "samples_lost", "rejoin_s")}
        medians[mode] = med
        print(f"{_LABELS[mode]:<36}{med['next_s']:>15.2f} s{med['back_s']:>20.2f} s{med['redone']:>14g}"
              f"{'-' if med['samples_lost'] is None else format(med['samples_lost'], 'g'):>14}"
              f"{_seconds(med['rejoin_s']) if mode == 'continue' else '-':>16}")
    ok = True
    if "continue" in results:
        worst = results["continue"]
        if args.device == "cpu":
            ok = all(r["next_s"] <= _TARGET_S and r["redone"] == 1 and r["samples_lost"] == 0 for r in worst)
            what = "1 step redone, no sample lost"
        else:  # the job was stopped once the device's worker trained again: no sample count
            ok = all(r["next_s"] <= _TARGET_S and r["redone"] == 1 and r["rejoin_s"] is not None for r in worst)
            what = f"1 step redone, the {args.device} worker rejoined"
        print(f"target (continue, every run): next step within {_TARGET_S:g} s, {what}: {'met' if ok else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results, "medians": medians}, f, indent=1)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
