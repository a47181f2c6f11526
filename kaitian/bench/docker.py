"""``kaitian bench docker``: the docker runtime against the local runtime, in one run.

Runs the same ``kaitianrun`` job (``--nproc`` workers split into ``--groups``
simulated CPU vendor groups, backend ``--backend``) under ``--runtime local``
and ``--runtime docker`` and prints, per runtime, the median over ``--runs``:

- launch to first collective: from starting ``kaitianrun`` until every rank
  has finished its first allreduce. The docker runs use ``--keep-containers``
  after one warm-up run, i.e. containers already created (the issue's case);
  the cold start (creating the containers) is printed too.
- allreduce bus bandwidth (nccl-tests formula ``2(n-1)/n * bytes / time``,
  best of three windows of ``--iters`` calls, slowest rank) of a ``--size-mb`` tensor between workers in separate containers vs separate
  local processes.
- the runtime's own start cost: asking for workers until a trivial program runs
  in each, ``start_processes`` vs ``docker exec`` into created containers
  (whole-job times are dominated by Python/torch start-up on a busy host).

Example::

    kaitian images build cpu-host          # once, on hosts without a registry
    kaitian bench docker --image cpu=kaitian:cpu --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from kaitian.bench import BenchParser

__all__ = ["main", "run_bench"]



_USER = f"{os.getuid()}:{os.getgid()}"


def _kaitianrun() -> List[str]:
    exe = shutil.which("kaitianrun")
    return [exe] if exe else [sys.executable, "-m", "kaitian.launcher.cli"]


def _one(runtime: str, args: argparse.Namespace, workdir: str, keep: bool) -> Dict[str, float]:
    """One kaitianrun job; returns launch-to-first-collective and bus bandwidth."""
    out = os.path.join(workdir, f"result-{runtime}-{time.monotonic_ns()}.json")
    cmd = _kaitianrun() + [
        "--standalone", "--nproc-per-node", str(args.nproc), "--cpu-groups", str(args.groups),
        "--runtime", runtime,
    ]
    if runtime == "docker":
        for image in args.image:
            cmd += ["--image", image]
        if keep:
            cmd.append("--keep-containers")
        # The workers' user is the local runtime's (this process's): a like-for-like comparison.
        cmd += ["--container-user", _USER]
    # the worker is this module (bench convention)
    cmd += ["-m", "kaitian.bench.docker", "--worker", args.backend, out, str(args.size_mb), str(args.iters)]
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    began = time.time()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        lines = proc.stderr.strip().splitlines()
        errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line][:3]
        tail = "\n".join(errors + lines[-8:])
        raise RuntimeError(f"kaitianrun --runtime {runtime} failed (exit {proc.returncode}):\n{tail}")
    with open(out) as f:
        result = json.load(f)
    return {"launch": result["first"] - began, "busbw": result["busbw"]}


_STAMP = "import sys, time; open(sys.argv[1], 'w').write(repr(time.time()))"


def _runtime_start_latency(args: argparse.Namespace, workdir: str, repeats: int = 5) -> Dict[str, float]:
    """Median seconds from asking a runtime for workers to every worker running
    (a program that only writes the time), local processes vs docker exec into
    already created containers. This isolates the runtime's own cost from
    Python/torch start-up, which dominates (and blurs) the whole-job numbers."""
    from kaitian._torch import DefaultLogsSpecs, start_processes
    from kaitian.devices.device import WorkerDevice
    from kaitian.launcher.workers import LocalWorker
    from kaitian.launcher.runtimes.base import RunContext, WorkerStart
    from kaitian.launcher.runtimes.docker.runtime import DockerRuntime
    from kaitian.launcher.runtimes.docker.options import DockerOptions
    from kaitian.launcher.runtimes.options import RuntimeOptions

    run_dir = os.path.join(workdir, "latency-run")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    ctx = RunContext(run_id="bench-latency", run_dir=run_dir, log_dir=None, cwd=workdir,
                     options=RuntimeOptions(own={"docker": DockerOptions.from_flags(images=args.image, container_user=_USER)}))
    cores = sorted(os.sched_getaffinity(0))
    workers = {
        r: LocalWorker(r, WorkerDevice("cpu", r, f"cpu{r % args.groups}"), (cores[r % len(cores)],))
        for r in range(args.nproc)
    }
    runtime = DockerRuntime(ctx)
    took: Dict[str, List[float]] = {"local": [], "docker": []}
    try:
        for i in range(repeats + 1):  # the first docker start creates the containers
            for kind in ("local", "docker"):
                stamps = {r: os.path.join(run_dir, f"{kind}-{i}-{r}") for r in workers}
                argv = {r: ("-c", _STAMP, stamps[r]) for r in workers}
                envs = {r: {"RANK": str(r)} for r in workers}
                logs = DefaultLogsSpecs(log_dir=os.path.join(run_dir, f"logs-{kind}-{i}"))
                began = time.time()
                if kind == "docker":
                    pc = runtime.start(WorkerStart("bench", sys.executable, argv, envs, logs, workers))
                else:
                    pc = start_processes(name="bench", entrypoint=sys.executable, args=argv,
                                         envs={r: {**os.environ, **e} for r, e in envs.items()}, logs_specs=logs)
                result = pc.wait(60, period=0.01)
                pc.close()
                if result is None or result.is_failed():
                    raise RuntimeError(f"{kind} workers failed in the start-latency check: {result}")
                if i > 0:
                    took[kind].append(max(float(open(p).read()) for p in stamps.values()) - began)
    finally:
        runtime.shutdown()
    return {k: statistics.median(v) for k, v in took.items()}


def _remove_kept(before: set) -> None:
    """Removes the containers this benchmark kept (not the user's)."""
    from kaitian.launcher.runtimes.docker.runtime import connect

    client = connect()
    for c in client.containers.list(all=True, filters={"label": ["org.kaitian.managed=1", "org.kaitian.keep=1"]}):
        if c.id not in before:
            c.remove(force=True)


def run_bench(args: argparse.Namespace) -> Dict[str, Dict[str, float]]:
    """Runs the benchmark; returns medians per runtime (and the cold docker start)."""
    from kaitian.launcher.runtimes.docker.runtime import connect

    client = connect()
    before = {
        c.id for c in client.containers.list(all=True, filters={"label": ["org.kaitian.managed=1", "org.kaitian.keep=1"]})
    }
    results: Dict[str, List[Dict[str, float]]] = {"local": [], "docker": []}
    cold: Optional[Dict[str, float]] = None
    latency: Dict[str, float] = {}
    workdir = tempfile.mkdtemp(prefix="kaitian-bench-docker-")
    try:
        print("[bench] runtime start latency (trivial program, containers created)", flush=True)
        latency = _runtime_start_latency(args, workdir)
        print("[bench] warm-up: docker run creating the containers (kept for the measured runs)", flush=True)
        cold = _one("docker", args, workdir, keep=True)
        for i in range(args.runs):
            for runtime in ("local", "docker"):  # interleaved: both see the same machine load
                r = _one(runtime, args, workdir, keep=True)
                results[runtime].append(r)
                print(f"[bench] run {i + 1}/{args.runs} {runtime:>6}: launch->first collective "
                      f"{r['launch']:.2f} s, busbw {r['busbw'] / 1e9:.2f} GB/s", flush=True)
    finally:
        _remove_kept(before)
        shutil.rmtree(workdir, ignore_errors=True)
    med = {rt: {k: statistics.median(r[k] for r in rs) for k in ("launch", "busbw")} for rt, rs in results.items()}
    if cold is not None:
        med["docker-cold"] = cold
    if latency:
        med["start-latency"] = latency
    return med


def _report(med: Dict[str, Dict[str, float]], args: argparse.Namespace) -> str:
    local, docker = med["local"], med["docker"]
    extra = docker["launch"] - local["launch"]
    ratio = docker["busbw"] / local["busbw"]
    lines = [
        f"kaitian bench docker: {args.nproc} workers in {args.groups} CPU groups, backend {args.backend}, "
        f"{args.size_mb} MiB allreduce, best of 3 x {args.iters}, median of {args.runs} runs",
        f"{'':28}{'local':>12}{'docker':>12}{'docker vs local':>20}   goal",
        f"{'launch -> first collective':28}{local['launch']:>10.2f} s{docker['launch']:>10.2f} s"
        f"{extra:>+18.2f} s   <= +2 s  {'met' if extra <= 2 else 'MISSED'}",
        f"{'allreduce bus bandwidth':28}{local['busbw'] / 1e9:>7.2f} GB/s{docker['busbw'] / 1e9:>7.2f} GB/s"
        f"{ratio:>19.2f}x   >= 0.9x  {'met' if ratio >= 0.9 else 'MISSED'}",
    ]
    if "start-latency" in med:
        lat = med["start-latency"]
        lines.append(f"{'worker start (runtime only)':28}{lat['local']:>10.2f} s{lat['docker']:>10.2f} s"
                     f"{lat['docker'] - lat['local']:>+18.2f} s   (start_processes vs docker exec)")
    if "docker-cold" in med:
        lines.append(f"(docker cold start, creating the containers: launch -> first collective "
                     f"{med['docker-cold']['launch']:.2f} s)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="kaitian bench docker", description=__doc__.split("\n\n")[0])
    p.add_argument("--image", action="append", default=[], metavar="VENDOR_OR_GROUP=IMAGE",
                   help="image for the docker runs (as kaitianrun --image); default: the vendor table's")
    p.add_argument("--nproc", type=int, default=2, help="workers (default 2)")
    p.add_argument("--groups", type=int, default=2, help="simulated CPU groups, one container each (default 2)")
    p.add_argument("--backend", default="kaitian", help="process-group backend (default kaitian)")
    p.add_argument("--size-mb", type=int, default=64, help="allreduce size in MiB (default 64)")
    p.add_argument("--iters", type=int, default=10, help="timed allreduces per run (default 10)")
    p.add_argument("--runs", type=int, default=5, help="measured runs per runtime (default 5)")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per kaitianrun job")
    return p


def _worker(argv: List[str]) -> int:
    """One rank (``--worker BACKEND OUT SIZE_MB ITERS``, under kaitianrun): the first
    allreduce's time and the allreduce bus bandwidth, written by rank 0 to OUT."""
    import torch
    import torch.distributed as dist

    backend, out, size_mb, iters = argv[0], argv[1], int(argv[2]), int(argv[3])
    if backend == "kaitian":
        import kaitian  # noqa: F401  registers the backend
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1)
    dist.all_reduce(t)
    first = time.time()
    x = torch.ones(size_mb * (1 << 20) // 4)
    for _ in range(3):
        dist.all_reduce(x)
    # Best of three windows: the host is shared, and a window that another
    # process preempted says nothing about the transport.
    took = float("inf")
    for _ in range(3):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        took = min(took, (time.perf_counter() - began) / iters)
    # The slowest rank's time is the collective's time.
    slow = torch.tensor([took, first], dtype=torch.float64)
    dist.all_reduce(slow, op=dist.ReduceOp.MAX)
    if rank == 0:
        nbytes = x.numel() * 4
        busbw = 2 * (world - 1) / world * nbytes / slow[0].item()
        with open(out, "w") as f:
            json.dump({"first": slow[1].item(), "time": slow[0].item(), "busbw": busbw}, f)
    dist.destroy_process_group()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kaitian bench docker [--image cpu=IMAGE] [--runs N] [--size-mb M] [--backend B]``."""
    from kaitian.errors import DockerRuntimeError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if min(args.nproc, args.size_mb, args.iters, args.runs) < 1 or not args.timeout > 0:
        parser.error("need --nproc, --size-mb, --iters and --runs >= 1, --timeout > 0")
    if not 1 <= args.groups <= args.nproc:
        parser.error(f"--groups must be between 1 and --nproc ({args.nproc})")
    try:
        med = run_bench(args)
    except (DockerRuntimeError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"kaitian bench docker: {exc}", file=sys.stderr)
        return 1
    print(_report(med, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
