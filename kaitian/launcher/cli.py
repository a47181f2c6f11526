"""``kaitianrun``: torchrun's command line plus kaitian's device layout.

The parser *is* torchrun's (``get_args_parser``) with kaitian's flags added,
and the launch config comes from torchrun's ``config_from_args``, so every
torchrun flag and ``PET_*`` variable means what it means for torchrun.
``kaitian run -f script.py [args]`` is the original project's command:
``kaitianrun --standalone --nproc-auto script.py [args]``.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import logging
import os
import shutil
import socket
import sys
import uuid
from typing import Dict, List, NoReturn, Optional

from kaitian import _torch as _te
from kaitian.launcher.launch import launch_agent
from kaitian.launcher.request import LaunchRequest
from kaitian.launcher.logs import build_logs_specs
from kaitian.launcher.workers import parse_cpu_quota, node_workers
from kaitian.launcher.rundir import RunDir, collect_stale
from kaitian.launcher.runtimes import RUNTIMES, RunContext, WorkerStart, get_runtime, options_from_args, runtime_class
from kaitian.launcher.runtimes.cpu_limits import quota_mode
from kaitian.errors import KaitianError, UsageError
from kaitian.settings import settings

__all__ = ["build_parser", "main", "run_alias", "UsageError"]

logger = logging.getLogger(__name__)

_PROG = "kaitianrun"


class _OneLineParser(argparse.ArgumentParser):
    """An argparse error is one line on stderr (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _EnvList(argparse.Action):
    """A repeatable flag whose ``PET_<DEST>`` form is a comma list (``PET_IMAGE=cuda=a,mlu=b``).

    The flags given on the command line replace the variable's list, as a
    torchrun flag replaces its ``PET_*`` value.
    """

    def __init__(self, dest: str, default=None, **kwargs) -> None:
        raw = os.environ.get(f"PET_{dest.upper()}", "")
        default = [v for v in raw.split(",") if v] if raw else list(default or [])
        super().__init__(dest=dest, default=default, **kwargs)
        self._from_env = default

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        if current is self._from_env:  # first use on the command line: drop the variable's list
            current = []
        setattr(namespace, self.dest, [*current, values])


def build_parser(prog: str = _PROG) -> argparse.ArgumentParser:
    """torchrun's parser with kaitian's flags.

    Returns:
        The parser; its ``error`` prints one line and exits with code 2.
    """
    parser = _te.get_args_parser()
    parser.__class__ = _OneLineParser  # same parser, one-line errors
    parser.prog = prog
    parser.description = (
        "kaitianrun: torchrun for heterogeneous devices. Every torchrun flag works; "
        "the kaitian flags below add device-aware worker layout."
    )
    k = parser.add_argument_group("kaitian")
    k.add_argument(
        "--nproc-auto",
        "--nproc_auto",
        action=_te.check_env,
        help="one worker per selected device, all vendors (USE_CUDA / USE_MLU / USE_CPU, "
        "or --devices); overrides --nproc-per-node",
    )
    k.add_argument(
        "--devices",
        action=_te.env,
        default=None,
        metavar="KEYS",
        help="devices to use, as keys: cuda:0,cuda:1,cpu (a bare type = all of it, "
        "type:-1 = none); types not named keep their USE_<TYPE> setting",
    )
    k.add_argument(
        "--cpu-slots", "--cpu_slots", type=int, action=_te.env, default=None, metavar="N",
        help="split this node's cores into N CPU slots (default: one per NUMA node)",
    )
    k.add_argument(
        "--cpu-groups", "--cpu_groups", type=int, action=_te.env, default=None, metavar="N",
        help="split the CPU workers into N simulated vendor groups cpu0..cpuN-1 (KAITIAN_GROUP)",
    )
    k.add_argument(
        "--cpu-quota", "--cpu_quota", action=_te.env, default=None, metavar="Q0,Q1,...",
        help="cores of CPU time per CPU group (one value for all groups, or one per group)",
    )
    k.add_argument(
        "--on-failure", "--on_failure", action=_te.env, choices=("restart", "continue"), default="restart",
        help="when a worker is lost: restart every worker (torchrun's behaviour, default) or continue: "
        "the others go on without it (kaitian.elastic.Trainer) and it rejoins when restarted",
    )
    k.add_argument(
        "--runtime", action=_te.env, choices=sorted(RUNTIMES), default="local",
        help="where workers run: local subprocesses or per-vendor docker containers",
    )
    k.add_argument(
        "--image", action=_EnvList, default=[], metavar="VENDOR_OR_GROUP=IMAGE",
        help="docker image for a vendor or group (repeatable), e.g. cuda=kaitian:cuda",
    )
    k.add_argument(
        "--keep-containers", "--keep_containers", action=_te.check_env,
        help="docker: leave the containers running after the run (reused next time)",
    )
    k.add_argument(
        "-v", "--volume", action=_EnvList, default=[], metavar="HOST:CTR[:ro]",
        help="docker: extra bind mount (repeatable)",
    )
    k.add_argument("--shm-size", "--shm_size", action=_te.env, default=None, help="docker: /dev/shm size (default 2g)")
    k.add_argument(
        "--container-user", "--container_user", action=_te.env, default=None, metavar="root|UID[:GID]",
        help="docker: user the workers run as (default: a non-root user: yours, or for a root "
        "agent the owner of the working directory)",
    )
    k.add_argument(
        "--dry-run", "--dry_run", action=_te.check_env,
        help="docker: print the containers and execs this node's first start would make, and start nothing",
    )
    k.add_argument(
        "--monitor", action=_te.env, nargs="?", const="kaitian-monitor", default=None, metavar="DIR",
        help="record per-rank throughput and utilisation; plot + summary in DIR "
        "(default ./kaitian-monitor) when the run ends",
    )
    return parser


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return 2


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        return  # a module name; python -m reports a missing one
    if args.no_python and not args.run_path:
        if os.path.sep in script:
            found = os.path.isfile(script) and os.access(script, os.X_OK)
        else:
            found = shutil.which(script) is not None
        if not found:
            raise UsageError(f"{script}: no such executable (with --no-python the script must be a program)")
        return
    if not os.path.isfile(script):
        raise UsageError(f"{script}: no such file")


def _check_not_shadowed(args: argparse.Namespace) -> None:
    """Refuses a folder named ``kaitian`` that would shadow the package in the workers.

    A worker's ``sys.path`` starts with the script's folder (the working
    directory with ``-m``). A ``kaitian`` folder there that is not the package
    (the clone, beside a script in the home directory) is imported as an empty
    namespace package, unless a later ``sys.path`` entry holds the real one
    (the editable install puts the clone's root there): then ``import
    kaitian`` would register nothing and every rank fail with "Unknown backend
    type kaitian".
    """
    if args.no_python:
        return
    first = os.getcwd() if args.module else os.path.dirname(os.path.abspath(args.training_script))
    spec = importlib.machinery.PathFinder.find_spec("kaitian", [first, *sys.path[1:]])
    if spec is not None and spec.origin in (None, "namespace"):
        import kaitian

        raise UsageError(
            f"{os.path.join(first, 'kaitian')}: this folder would be imported as `kaitian` by the workers "
            f"instead of kaitian itself ({os.path.dirname(kaitian.__file__)}); rename it or move the script "
            "elsewhere, or reinstall kaitian editable (make setup)"
        )


def _capabilities() -> Dict[str, float]:
    from kaitian.training.capability import CapabilityConfigError, load_capabilities

    try:
        return dict(load_capabilities())
    except CapabilityConfigError as e:  # a broken config must not stop the launch
        logger.warning("%s", e)
        return {}


def _resolve_rendezvous(args: argparse.Namespace) -> Optional[int]:
    """torchrun's ``run()`` preamble: ``--standalone`` and single-node defaults.

    Returns:
        The fixed port of the workers' store: ``--master-port`` (or
        ``PET_MASTER_PORT``) when given with a dynamic rendezvous (``c10d``,
        ``kaitian``), where torchrun would ignore it. With ``static`` it is the
        rendezvous store's own port, which outlives restarts; ``None`` then.

    Raises:
        UsageError: a malformed ``--nnodes``.
    """
    explicit_port = args.master_port
    try:
        _, max_nodes = _te.parse_min_max_nnodes(args.nnodes)
    except ValueError:
        raise UsageError(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX") from None
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if explicit_port is None or args.rdzv_backend == "static" or args.standalone:
        return None
    return int(explicit_port)


def _check_config(config, args: argparse.Namespace) -> None:
    """What torch checks only once the start is under way (with a traceback, the run directory made)."""
    if config.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node {args.nproc_per_node}: a node starts at least 1 worker")
    if config.monitor_interval <= 0:
        raise UsageError(f"--monitor-interval {config.monitor_interval}: give seconds, more than 0")
    if not 0 <= args.master_port < 2**16:  # before the endpoint, which a static rendezvous makes of it
        raise UsageError(f"--master-port {args.master_port}: a port is 0 to 65535")
    try:
        _te.parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=0)
    except ValueError as e:
        raise UsageError(f"--rdzv-endpoint {config.rdzv_endpoint!r}: {e}") from None
    if args.log_dir and os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        raise UsageError(f"--log-dir {args.log_dir}: is a file, not a directory")
    if config.local_addr:
        try:
            socket.getaddrinfo(config.local_addr, None)
        except OSError as e:  # (else every peer waits for it until the rendezvous times out)
            raise UsageError(f"--local-addr {config.local_addr!r}: cannot be resolved ({e.strerror})") from None
    handler = _te.launch_option(config, "event_log_handler")
    if handler is not None and handler not in _te.event_log_handlers:
        known = ", ".join(sorted(_te.event_log_handlers))
        raise UsageError(f"--event-log-handler {handler!r}: unknown; registered: {known}")


@_te.record
def _launch(config, cmd, cmd_args, kaitian: LaunchRequest):
    return launch_agent(config, cmd, cmd_args, kaitian)


def run(args: argparse.Namespace) -> int:
    """Launches the job described by parsed arguments (torchrun's ``run`` with kaitian's layout).

    Returns:
        0, or 1 when the workers failed (torchrun's root-cause summary printed).

    Raises:
        UsageError, DeviceSelectionError, NodeWorkersError: bad input (nothing was started).
        SignalException: as torchrun.
    """
    _check_script(args)
    if args.runtime == "local":  # a container's interpreter has its own kaitian
        _check_not_shadowed(args)
    settings()  # a bad KAITIAN_* (KAITIAN_JOB_KEY, ...) fails here, before anything starts
    worker_store_port = _resolve_rendezvous(args)
    known = _te.rendezvous_backend_names()
    if args.rdzv_backend not in known:
        raise UsageError(f"--rdzv-backend {args.rdzv_backend}: unknown; registered: {', '.join(known)}")
    omp_from_user = "OMP_NUM_THREADS" in os.environ
    cpu_quota = parse_cpu_quota(args.cpu_quota)
    node_kwargs = dict(
        devices_flag=args.devices,
        cpu_slots=args.cpu_slots,
        cpu_groups=args.cpu_groups,
        cpu_quota=cpu_quota,
        own_device_only=bool(getattr(args, "virtual_local_rank", False)),  # torch 2.10+
        numa_binding=getattr(args, "numa_binding", None),  # torch 2.9+
    )
    node = None
    if args.nproc_auto:
        node = node_workers(nproc_auto=True, nproc_per_node=None, **node_kwargs)
        args.nproc_per_node = str(len(node.workers))
        if not omp_from_user and len(node.workers) > 1:
            # torchrun's default (1) without its warning: CPU slots get their core count anyway.
            os.environ["OMP_NUM_THREADS"] = "1"
    try:
        # Without --logs-specs kaitian builds its own specs below; torch's default
        # ones would create an empty torchelastic_* temp dir that nobody removes.
        torch_args = (
            argparse.Namespace(**{**vars(args), "log_dir": os.devnull})
            if args.logs_specs is None else args
        )
        config, cmd, cmd_args = _te.config_from_args(torch_args)
    except (AssertionError, RuntimeError, ValueError) as e:
        raise UsageError(str(e)) from None
    _check_config(config, args)
    if node is None:
        node = node_workers(nproc_auto=False, nproc_per_node=config.nproc_per_node, **node_kwargs)

    if args.runtime == "local" and node.cpu_quotas:
        quota_mode(settings().cpu_quota_mode)  # fails here, before anything starts
    runtime_options = options_from_args(args, config)  # every runtime flag checked before anything starts
    docker_flags = [flag for flag, given in (
        ("--image", args.image), ("--keep-containers", args.keep_containers), ("--volume", args.volume),
        ("--shm-size", args.shm_size), ("--container-user", args.container_user)) if given]
    if docker_flags and args.runtime != "docker":
        raise UsageError(f"{', '.join(docker_flags)}: the docker runtime's flags; add --runtime docker "
                         "(or unset their PET_* variables)")
    collect_stale()
    stale = runtime_class(args.runtime).collect_stale()
    if stale:
        logger.warning("removed what killed agents left behind: %s", ", ".join(stale))
    run_dir = RunDir(config.run_id)
    succeeded = False
    failure = None
    try:
        if args.logs_specs is None:
            ranks = (
                set(map(int, args.local_ranks_filter.split(","))) if args.local_ranks_filter else None
            )
            config.logs_specs = build_logs_specs(
                log_dir=args.log_dir or run_dir.log_dir,
                redirects=args.redirects,
                tee=args.tee,
                local_ranks_filter=ranks,
                nproc=config.nproc_per_node,
            )
        monitor_dir = os.path.abspath(args.monitor) if args.monitor else None
        if monitor_dir:
            os.makedirs(monitor_dir, exist_ok=True)
        runtime = get_runtime(
            args.runtime,
            RunContext(
                run_id=config.run_id,
                run_dir=run_dir.path,
                log_dir=args.log_dir,
                cwd=os.getcwd(),
                options=runtime_options,
                cpu_quotas=node.cpu_quotas,
            ),
        )
        kaitian = LaunchRequest(
            node=node,
            run_dir=run_dir,
            runtime=runtime,
            capabilities=_capabilities(),
            monitor_dir=monitor_dir,
            omp_from_user=omp_from_user,
            worker_store_port=worker_store_port,
            on_failure=args.on_failure,
            min_nodes=config.min_nodes,
        )
        if args.dry_run:
            print(_dry_run(kaitian, config, cmd, cmd_args))
            succeeded = True
            return 0
        try:
            _launch(config, cmd, cmd_args, kaitian)
            succeeded = True
        except _te.ChildFailedError as e:
            failure = e
    finally:
        # After @record has copied the root cause's error file: it lives in here.
        kept = run_dir.finish(succeeded)
        if failure is not None:
            # torchrun's summary without the launcher's own traceback: the workers' errors are above
            print(failure, file=sys.stderr, flush=True)
        if kept:  # last, where a reader looks first
            print(f"{_PROG}: the workers' logs are kept in {kept}", file=sys.stderr, flush=True)
    return 0 if failure is None else 1


def _dry_run(request: LaunchRequest, config, cmd, cmd_args) -> str:
    """``--dry-run``: this node's first docker start (a ``DockerStart``), as YAML.

    Ranks and torch's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` …)
    come from the rendezvous at the start; it shows every worker with
    local ranks and the variables kaitian sets, the job key hidden.

    Raises:
        UsageError: a runtime other than docker.
    """
    runtime = request.runtime
    if not hasattr(runtime, "docker_start"):
        raise UsageError(f"--dry-run prints the docker start; --runtime {runtime.name} has none to print")
    from kaitian.launcher.attempt import Attempt
    from kaitian.launcher.environment import worker_environment

    workers = {w.local_rank: w for w in request.node.workers}
    attempt = Attempt(
        number=1, placement=None, workers_store=("", 0), agent_store=False, serves_store=True,
        job_key="(made at the start)", elastic_run="1", start_dir=os.path.join(request.run_dir.path, "start0"),
        torchrun={lr: (tuple(cmd_args), {}) for lr in workers},
    )
    seen = runtime.devices_seen(workers)
    node = f"{socket.gethostname()}:{os.getpid()}"  # as the agent names its workers
    envs = {lr: worker_environment(w, attempt, request, f"{node}/{lr}/0", container=seen.get(lr))
            for lr, w in workers.items()}
    job = WorkerStart(name=config.role, entrypoint=cmd, args={lr: tuple(cmd_args) for lr in workers}, envs=envs,
                      logs_specs=config.logs_specs, workers=workers)
    return ("# kaitianrun --dry-run: torch's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) are added at the start\n"
            + runtime.docker_start(job).to_text(inherited=os.environ))


def main(argv: Optional[List[str]] = None) -> int:
    """The ``kaitianrun`` console script.

    Returns:
        0 on success; 2 for bad input (one line on stderr); 1 when the workers
        failed (torchrun's root-cause summary). Signals raise as under torchrun.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _te.set_thread_name("pt_elastic")
    _te.speed_up_rendezvous_events()
    try:
        return run(args)
    except KaitianError as e:  # user-facing: says what to do; anything else is torchrun-like
        return _fail(str(e))


def run_alias(argv: Optional[List[str]] = None) -> int:
    """``kaitian run -f script.py [script args]``: the original project's command.

    Same as ``kaitianrun --standalone --nproc-auto script.py [script args]``;
    other kaitianrun flags may come before ``-f``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-f" not in argv and "--file" not in argv:
        print("kaitian run: error: usage: kaitian run [KAITIANRUN FLAGS] -f SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    i = argv.index("-f") if "-f" in argv else argv.index("--file")
    if i + 1 >= len(argv):
        print("kaitian run: error: -f needs a script", file=sys.stderr)
        return 2
    flags, script, rest = argv[:i], argv[i + 1], argv[i + 2:]
    extra = []
    if "--standalone" not in flags and not any(f.startswith("--rdzv") for f in flags):
        extra.append("--standalone")
    if "--nproc-auto" not in flags and not any(f.startswith("--nproc") for f in flags):
        extra.append("--nproc-auto")
    return main([*extra, *flags, script, *rest])


if __name__ == "__main__":
    sys.exit(main())
