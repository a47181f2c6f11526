#!/usr/bin/env python3
"""One command for a GPU lease: builds kaitian, then checks it on the GPU, part by part.

Run from the repository root of a checkout, on a machine with one NVIDIA GPU and
torch with CUDA (no internet needed: nothing is installed, the extension is built
in place; Lightning, Accelerate and transformers are used where installed)::

    python3 scripts/lease_check.py                  # under 8 minutes on one H200 + 16 cores (not yet run there)
    python3 scripts/lease_check.py --dry-run        # the same on kaitian's fake MLU, smaller (CI runs it)

Each part runs under its own deadline, in this order, and prints one line as it
ends (PASS, FAIL or SKIP, its seconds, what it measured):

build         ``setup.py build_ext --inplace`` (MAX_JOBS: this host's cores)
device        ``scripts/cuda_check.py``: one GPU rank + two CPU ranks, every phase
<trainer>     Lightning, Accelerate and the HF Trainer on GPU + CPU (``--capabilities
              3,1``), each against a one-process replay of its logged batches
demo <h>      ``examples/train_digits.py --hidden <h>`` (1024, 4096) on GPU + CPU
              against the GPU alone, the same global batch: the ratio of throughputs
rejoin        ``kaitian bench recovery --device cuda``: under ``--on-failure
              continue`` the GPU worker is killed; kill -> next step, kill -> rejoined
copy          the device's own pinned device-to-host and host-to-device copy
              bandwidth beside the bridge's (the device part's all_reduce busbw):
              the ceiling of a host-staged bridge, and the ratio
collectives   ``kaitian bench collectives`` on CPU groups at 8 and 16 ranks

Every part's output goes to its own log in ``--out`` (default ``lease-<time>``),
the summary too (``summary.txt``). Exit status 0 when no part failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = {"lightning": "lightning_train.py", "accelerate": "accelerate_train.py",
            "hf_trainer": "hf_trainer_train.py"}
TRAINER_PACKAGES = {"lightning": "lightning", "accelerate": "accelerate", "hf_trainer": "transformers"}
# The dry run's trainer: one proves the part's plumbing (tests/training runs all
# three on CPU groups). Accelerate knows no fake MLU (it finds an MLU through
# torch_mlu): on one it wraps no DDP on the MLU rank and the ranks' collectives differ.
DRY_TRAINERS = ("hf_trainer",)


class Lease:
    """The parts' runner: logs, deadlines, results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out, self.results = args, args.out, []
        self.dev = "mlu" if args.dry_run else "cuda"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("KAITIAN_", "USE_"))}
        self.env.update(PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
                        PYTHONUNBUFFERED="1")
        if args.dry_run:  # one fake MLU stands in for the GPU
            self.env["KAITIAN_FAKE_ACCELERATOR"] = "mlu:1"

    def log(self, name: str) -> str:
        return os.path.join(self.out, f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.log")

    def run(self, name: str, cmd, deadline: float, env=None, cwd: str = REPO) -> tuple:
        """Runs ``cmd`` into ``name``'s log under ``deadline`` seconds; (exit status or None at the deadline, text)."""
        with open(self.log(name), "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                    env={**self.env, **(env or {})}, start_new_session=True)
            try:
                code = proc.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                code = None
            with contextlib.suppress(ProcessLookupError):  # all of it at the deadline, or what it left behind
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with open(self.log(name)) as f:
            return code, f.read()

    def part(self, name: str, fn, deadline: float) -> None:
        """Runs part ``name`` (``fn(deadline)`` returns (verdict, note)) and records its line."""
        start = time.monotonic()
        try:
            verdict, note = fn(deadline)
        except Exception as e:  # a part's own bug fails that part alone
            verdict, note = "FAIL", f"{type(e).__name__}: {e}"
        line = f"{verdict:<5} {name:<18} {time.monotonic() - start:>5.0f} s  {note}"
        self.results.append((verdict, line))
        print(line, flush=True)

    def kaitianrun(self, *args: str) -> list:
        return [sys.executable, "-m", "kaitian.launcher.cli", "--standalone", *args]

    def device_and_cpu(self) -> dict:
        """One device worker and one CPU worker under ``--nproc-auto``."""
        return {"USE_CUDA": "0" if self.dev == "cuda" else "-1", "USE_MLU": "0" if self.dev == "mlu" else "-1",
                "USE_CPU": "0"}

    def device_alone(self) -> dict:
        return {**self.device_and_cpu(), "USE_CPU": "-1"}


def _status(code, deadline: float) -> str:
    return f"deadline ({deadline:.0f} s) passed" if code is None else f"exit {code}"


def part_build(lease: Lease, deadline: float) -> tuple:
    if lease.args.no_build:
        return "SKIP", "--no-build: the extension is built"
    jobs = str(os.cpu_count() or 1)
    code, _ = lease.run("build", [sys.executable, "setup.py", "build_ext", "--inplace"], deadline,
                        env={"MAX_JOBS": jobs})
    return ("PASS" if code == 0 else "FAIL"), f"MAX_JOBS={jobs}, {_status(code, deadline)}"


def part_device(lease: Lease, deadline: float) -> tuple:
    cmd = [sys.executable, os.path.join(REPO, "scripts", "cuda_check.py"), "--device", lease.dev]
    if lease.args.dry_run:  # 20 MiB reductions still span two 16 MiB segments
        cmd += ["--big-mib", "20", "--sizes", "4M", "--iters", "3"]
    code, text = lease.run("device", cmd, deadline)
    counts = re.search(r"^cuda_check: (\d+) checks, (\d+) passed, (\d+) failed", text, re.M)
    failed = re.findall(r"^FAILED  (.*)$", text, re.M)
    note = f"{counts.group(2)} of {counts.group(1)} checks passed" if counts else _status(code, deadline)
    return ("PASS" if code == 0 else "FAIL"), note + (f"; failed: {'; '.join(failed)}"[:300] if failed else "")


def part_trainer(lease: Lease, name: str, deadline: float) -> tuple:
    import importlib.util

    if lease.args.dry_run and name not in DRY_TRAINERS:
        return "SKIP", f"dry run: {', '.join(DRY_TRAINERS)} only"
    if importlib.util.find_spec(TRAINER_PACKAGES[name]) is None:
        return "SKIP", f"{TRAINER_PACKAGES[name]} is not installed"
    if os.path.join(REPO, "tests") not in sys.path:  # the tests' replay, and the examples' common module
        sys.path[:0] = [os.path.join(REPO, "tests"), os.path.join(REPO, "examples")]
    from support.replay import max_difference, replay_weights

    work = tempfile.mkdtemp(prefix=f"{name}-", dir=lease.out)
    logs, weights = os.path.join(work, "batches"), os.path.join(work, "weights.json")
    os.makedirs(logs)
    samples = "473"  # 14 steps of 32 and a short last one
    cmd = lease.kaitianrun("--nproc-auto", os.path.join(REPO, "examples", TRAINERS[name]), "--capabilities", "3,1",
                           "--samples", samples, "--log-batches", logs, "--save", weights)
    code, _ = lease.run(name, cmd, deadline, env={**lease.device_and_cpu(),
                                                  "PYTHONPATH": lease.env["PYTHONPATH"] + os.pathsep +
                                                  os.path.join(REPO, "examples")}, cwd=work)
    if code != 0:
        return "FAIL", _status(code, deadline)
    with open(weights) as f:
        diff = max_difference(json.load(f), replay_weights(logs, 2, lr=0.1, samples=int(samples)))
    return ("PASS" if diff < 1e-9 else "FAIL"), f"{lease.dev} + CPU vs one process: largest difference {diff:.1e}"


_THROUGHPUT = re.compile(r"trained (\d+) epochs in ([\d.]+) s \(([\d.]+) samples/s overall\)")


def part_demo(lease: Lease, hidden: int, deadline: float) -> tuple:
    """GPU + CPU (64 each) against the GPU alone (128): the same global batch of 128."""
    epochs = "1" if lease.args.dry_run else "10"
    rates, failed = {}, []
    for label, env, batch in (("hetero", lease.device_and_cpu(), "64"), ("alone", lease.device_alone(), "128")):
        cmd = lease.kaitianrun("--nproc-auto", os.path.join(REPO, "examples", "train_digits.py"), "--hidden",
                               str(hidden), "--batch-size", batch, "--epochs", epochs, "--min-accuracy", "0")
        code, text = lease.run(f"demo-{hidden}", cmd, deadline / 2, env=env)
        found = _THROUGHPUT.findall(text[text.rindex("$ "):])  # this run's part of the log
        if found:
            rates[label] = float(found[-1][2])
        if code != 0:  # (a job that trained but did not end in time has its numbers)
            failed.append(f"{label}: {_status(code, deadline / 2)}")
    note = "; ".join(failed)
    if len(rates) == 2:
        note = (f"{lease.dev} + CPU {rates['hetero']:.0f} samples/s, {lease.dev} alone {rates['alone']:.0f}: "
                f"ratio {rates['hetero'] / rates['alone']:.2f}" + (f"; {note}" if note else ""))
    return ("FAIL" if failed or len(rates) < 2 else "PASS"), note


def part_rejoin(lease: Lease, deadline: float) -> tuple:
    """The device's worker killed under ``--on-failure continue``; the job stops once it trained again."""
    result = os.path.join(lease.out, "rejoin.json")
    small = ["--samples", "3840", "--hidden", "256", "--kill-at", "10"] if lease.args.dry_run else []
    cmd = [sys.executable, "-m", "kaitian", "bench", "recovery", "--device", lease.dev, "--modes", "continue",
           "--repeats", "1", "--epochs", "100", "--timeout", str(max(5, int(deadline) - 10)), "--json", result, *small]
    code, _ = lease.run("rejoin", cmd, deadline)
    if code is None or not os.path.exists(result):
        return "FAIL", _status(code, deadline)
    with open(result) as f:
        (run,) = json.load(f)["runs"]["continue"]
    parts = ", ".join(f"{k} +{v:.1f} s" for k, v in run["rejoin_parts"].items())
    rejoin = "never" if run["rejoin_s"] is None else f"{run['rejoin_s']:.1f} s"
    return ("PASS" if code == 0 and run["rejoin_s"] is not None else "FAIL"), (
        f"{lease.dev} worker killed: next step {run['next_s']:.1f} s, rejoined {rejoin} ({parts})")


COPY_BANDWIDTH = """
import sys, time, torch, kaitian
dev, n = torch.device(sys.argv[1], 0), int(sys.argv[2])
host, on_dev = torch.empty(n, dtype=torch.uint8, pin_memory=True), torch.empty(n, dtype=torch.uint8, device=dev)
mod = getattr(torch, dev.type)
for name, dst, src in (("d2h", host, on_dev), ("h2d", on_dev, host)):
    dst.copy_(src, non_blocking=True); mod.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    mod.synchronize()
    print(name, n * 10 / (time.perf_counter() - start) / 1e9)
"""


def part_copy(lease: Lease, deadline: float) -> tuple:
    """The pinned copy bandwidth beside the bridge's busbw from the device part (its largest all_reduce)."""
    size = (4 if lease.args.dry_run else 64) << 20
    code, text = lease.run("copy", [sys.executable, "-c", COPY_BANDWIDTH, lease.dev, str(size)], deadline)
    copies = {k: float(v) for k, v in re.findall(r"^(d2h|h2d) ([\d.e+-]+)$", text, re.M)}
    if code != 0 or len(copies) != 2:
        return "FAIL", _status(code, deadline)
    note = f"pinned D2H {copies['d2h']:.1f} GB/s, H2D {copies['h2d']:.1f} GB/s"
    bridge = {int(m): float(bw) for m, bw in re.findall(r"^allreduce\s+(\d+) MiB\s+[\d.]+\s+([\d.]+)",
                                                        open(lease.log("device")).read() if
                                                        os.path.exists(lease.log("device")) else "", re.M)}
    if not bridge:
        return "FAIL", note + "; no bridge bandwidth in the device part's log"
    mib = size >> 20 if size >> 20 in bridge else max(bridge)
    ratio = bridge[mib] / min(copies.values())
    return "PASS", note + f"; bridge all_reduce {mib} MiB busbw {bridge[mib]:.2f} GB/s = {ratio:.2f}x the slower copy"


def part_collectives(lease: Lease, nproc: int, deadline: float) -> tuple:
    sizes = "1M" if lease.args.dry_run else "4K,1M,64M"
    cmd = [sys.executable, "-m", "kaitian", "bench", "collectives", "--nproc", str(nproc), "--groups", "2", "--ops",
           "allreduce", "--sizes", sizes, "--ddp-steps", "0", "--timeout", str(max(5, int(deadline) - 5))]
    code, text = lease.run(f"collectives-{nproc}", cmd, deadline)
    rows = re.findall(r"^allreduce\s+(\d+ [KMG]iB)\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s+([\d.]+)x",
                      text, re.M)
    if code != 0 or not rows:
        return "FAIL", _status(code, deadline)
    return "PASS", "allreduce busbw vs gloo: " + ", ".join(f"{size} {kt} GB/s = {x}x" for size, kt, _, x in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="kaitian's fake MLU in place of the GPU, smaller sizes, no build (CI runs this)")
    ap.add_argument("--no-build", action="store_true", help="the extension is built already")
    ap.add_argument("--out", default="", help="the folder for every log (default lease-<time>)")
    ap.add_argument("--parts", default="", help="comma list of parts to run (default: all)")
    ap.add_argument("--budget", type=float, default=480.0,
                    help="seconds for the whole run (default 480): a part gets at most what is left, "
                         "and fails unrun once it is spent")
    args = ap.parse_args(argv)
    args.no_build = args.no_build or args.dry_run
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("lease_check: torch sees no GPU (torch.cuda.is_available() is False); "
                  "use --dry-run for the fake MLU", file=sys.stderr)
            return 2
    args.out = os.path.abspath(args.out or f"lease-{time.strftime('%Y%m%d-%H%M%S')}")
    lease = Lease(args)
    dry = args.dry_run
    bind = functools.partial
    parts = [("build", bind(part_build, lease), 150), ("device", bind(part_device, lease), 150 if dry else 240)]
    parts += [(name, bind(part_trainer, lease, name), 90) for name in TRAINERS]
    # (a dry run shares CI's two busy cores: one of its demo jobs once took 45 s to start and stop)
    parts += [(f"demo {h}", bind(part_demo, lease, h), 180 if dry else 90) for h in ((64,) if dry else (1024, 4096))]
    parts += [("rejoin", bind(part_rejoin, lease), 90), ("copy", bind(part_copy, lease), 30)]
    parts += [(f"collectives {n}", bind(part_collectives, lease, n), 60 if dry else 120)
              for n in ((4,) if dry else (8, 16))]
    chosen = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(chosen) - {name.split()[0] for name, _, _ in parts})
    if unknown:
        print(f"lease_check: no part named {', '.join(unknown)} (parts: "
              f"{', '.join(dict.fromkeys(name.split()[0] for name, _, _ in parts))})", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    print(f"lease_check: {'dry run on the fake MLU' if dry else 'GPU'}; logs in {args.out}", flush=True)
    for name, fn, deadline in parts:
        if chosen and name.split()[0] not in chosen:
            continue
        left = start + args.budget - time.monotonic()
        if left < 10:
            lease.part(name, lambda d: ("FAIL", f"not run: the run's {args.budget:.0f} s were spent"), 0)
        else:
            lease.part(name, fn, min(deadline, left))
    failed = [line for verdict, line in lease.results if verdict == "FAIL"]
    summary = (f"lease_check: {len(lease.results) - len(failed)} of {len(lease.results)} parts passed or skipped, "
               f"{len(failed)} failed, in {time.monotonic() - start:.0f} s; logs in {args.out}\n"
               + "\n".join(line for _, line in lease.results) + "\n")
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(summary)
    print(summary, end="", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
