"""``kaitian bench launch``: kaitianrun vs torchrun, start-up and recovery, in one run.

For the same worker script and the same flags, each launcher is timed (runs
interleaved, ``--repeats`` each; the medians decide the ratio, best runs are
printed too) for:

- launch -> first collective: from starting the launcher to the moment the
  last rank has completed its first allreduce;
- recovery: from SIGKILL of one worker to the moment the restarted group has
  completed an allreduce again (``--max-restarts 1``).

torch 2.13's torchrun cannot recover with the default shared agent store
(restarted workers read the previous attempt's store keys and hang), so its
recovery runs use torch's own switch ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
kaitianrun needs no switch. Target: kaitianrun <= 1.1x torchrun on both.
"""

from __future__ import annotations

import glob
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

# The worker is this module (``--worker``), run by the launcher under test (bench convention).
_WORKER = ["-m", "kaitian.bench.launch", "--worker"]
_LAUNCHERS = {
    "kaitianrun": [sys.executable, "-m", "kaitian.launcher.cli"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def _env(launcher: str, recover: bool) -> Dict[str, str]:
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if launcher == "torchrun" and recover:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _wait(pattern: str, count: int, proc: subprocess.Popen, timeout: float) -> List[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = glob.glob(pattern)
        if len(found) >= count:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {proc.returncode} before {pattern} appeared")
        time.sleep(0.005)
    raise TimeoutError(f"timed out waiting for {pattern}")


def _last_time(files: List[str]) -> float:
    return max(float(open(f).read()) for f in files)


def _one(launcher: str, flags: List[str], nproc: int, backend: str, recover: bool, timeout: float) -> float:
    with tempfile.TemporaryDirectory(prefix="kaitian-bench-launch-") as out:
        cmd = [*_LAUNCHERS[launcher], *flags, *_WORKER, out, "recover" if recover else "start", backend]
        start = time.time()
        proc = subprocess.Popen(cmd, env=_env(launcher, recover), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            first = _wait(os.path.join(out, "first.0.*[0-9]"), nproc, proc, timeout)
            if not recover:
                proc.wait(timeout=timeout)
                return _last_time(first) - start
            victim = int(open(os.path.join(out, f"pid.0.{nproc - 1}")).read())
            time.sleep(0.5)  # steady state: the group is allreducing
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            again = _wait(os.path.join(out, "first.1.*[0-9]"), nproc, proc, timeout)
            proc.wait(timeout=timeout)
            return _last_time(again) - killed
        finally:
            stop_session(proc, grace_s=35)


def _worker(out: str, mode: str, backend: str) -> int:
    """One rank: init, one allreduce, record when it completed (``recover``: on the
    first attempt keep allreducing until the benchmark kills a peer)."""
    import torch
    import torch.distributed as dist

    if backend == "kaitian":
        import kaitian  # noqa: F401  registers the backend
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    done = time.time()
    with open(os.path.join(out, f"pid.{restart}.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(out, f"first.{restart}.{rank}.tmp"), "w") as f:
        f.write(repr(done))
    os.replace(os.path.join(out, f"first.{restart}.{rank}.tmp"), os.path.join(out, f"first.{restart}.{rank}"))
    if mode == "recover" and restart == 0:
        while True:  # until a peer is killed: the allreduce then fails and the agent restarts us
            dist.all_reduce(t)
            time.sleep(0.02)
    dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the benchmark and prints a table; returns 0 (1 if a target is missed with --check)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(*argv[1:4])
    parser = BenchParser(prog="kaitian bench launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per launcher and measurement")
    parser.add_argument("--nproc", type=int, default=2, help="workers")
    parser.add_argument("--backend", default="gloo", help="process group backend of the worker")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--check", action="store_true", help="exit 1 if a ratio is above 1.1")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.nproc < 1 or not args.timeout > 0:
        parser.error("need --repeats >= 1, --nproc >= 1, --timeout > 0")

    flags = ["--standalone", "--nproc-per-node", str(args.nproc), "--max-restarts", "1"]
    results: Dict[str, Dict[str, List[float]]] = {
        name: {"start": [], "recover": []} for name in _LAUNCHERS
    }
    for what in ("start", "recover"):
        for i in range(args.repeats):
            order = list(_LAUNCHERS) if i % 2 == 0 else list(reversed(_LAUNCHERS))
            for name in order:
                seconds = _one(name, flags, args.nproc, args.backend, what == "recover", args.timeout)
                results[name][what].append(seconds)
                print(f"  {what:<8} {name:<11} run {i + 1}: {seconds:.3f} s", flush=True)

    print()
    print(f"kaitian bench launch: {args.nproc} workers, backend {args.backend}, {args.repeats} interleaved runs "
          f"each (flags: {' '.join(flags)})")
    print("the median decides the ratio (the host is shared: single runs swing by +-50 %); best runs for reference")
    print(f"{'measurement':<34}{'kaitianrun':>12}{'torchrun':>12}{'ratio':>8}{'target':>9}"
          f"{'best k':>10}{'best t':>10}")
    ok = True
    for what, label in (("start", "launch -> first collective (s)"), ("recover", "killed worker -> collective (s)")):
        k = statistics.median(results["kaitianrun"][what])
        t = statistics.median(results["torchrun"][what])
        ratio = k / t
        ok &= ratio <= 1.1
        print(f"{label:<34}{k:>12.3f}{t:>12.3f}{ratio:>8.2f}{'<= 1.10':>9}"
              f"{min(results['kaitianrun'][what]):>10.3f}{min(results['torchrun'][what]):>10.3f}")
    print("(torchrun recovery runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it torch 2.13 hangs on restart)")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
