"""Every torch-private ``torch.distributed.elastic`` / ``torch.distributed.run`` name kaitian uses.

kaitianrun is built on torchelastic without forking its files. The names below
are not all part of torch's stable API, so they are imported here and nowhere
else: a torch upgrade that moves one of them touches this file only. kaitian
supports torch 2.4 to 2.15 (``SUPPORTED_TORCH``); a name that only some of
those releases have is feature-detected here, with the older releases'
behaviour as the fallback.

Every torchelastic name is resolved on first use (see ``_LATE``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Iterator

import torch.multiprocessing as _mp

# The releases kaitian is built and tested with: [oldest, newest] as (major, minor).
SUPPORTED_TORCH = ((2, 4), (2, 15))


# --- torchrun's command line -------------------------------------------------
def _no_thread_name(name: str) -> None:
    """torch 2.4 has no ``_set_thread_name`` (2.5+); its torchrun names no thread either."""


set_thread_name = getattr(_mp, "_set_thread_name", _no_thread_name)

# torchrun --run-path's entrypoint, run_script_path, runs the script with runpy in the worker's python;
# a runtime that starts programs runs the same as ``python -c RUN_SCRIPT_PATH_CODE SCRIPT ARGS``.
RUN_SCRIPT_PATH_CODE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def is_run_script_path(entrypoint) -> bool:
    return getattr(entrypoint, "__name__", "") == "run_script_path"


# Every torchelastic name is resolved on first use (module __getattr__ below):
# `import kaitian` (every worker) stays free of the agent's modules, and under
# plain torchrun this module is imported by the torchrun.handlers entry point
# while torch.distributed.run, launcher.api and the rendezvous package are
# half-initialised. Name -> (module, attribute; None = the module itself).
_R = "torch.distributed.elastic.rendezvous"
_AGENT = "torch.distributed.elastic.agent.server"
_MP = "torch.distributed.elastic.multiprocessing"
_LATE = {
    # torchrun's command line
    "check_env": ("torch.distributed.argparse_util", "check_env"),  # PET_* flag actions
    "env": ("torch.distributed.argparse_util", "env"),
    "config_from_args": ("torch.distributed.run", "config_from_args"),
    "get_args_parser": ("torch.distributed.run", "get_args_parser"),
    "parse_min_max_nnodes": ("torch.distributed.run", "parse_min_max_nnodes"),
    "LaunchConfig": ("torch.distributed.launcher.api", "LaunchConfig"),
    "get_addr_and_port": ("torch.distributed.launcher.api", "_get_addr_and_port"),
    "get_entrypoint_name": ("torch.distributed.launcher.api", "_get_entrypoint_name"),
    "parse_rendezvous_endpoint": (_R + ".utils", "parse_rendezvous_endpoint"),
    # the agent
    "events": ("torch.distributed.elastic.events", None),
    "event_log_handlers": ("torch.distributed.elastic.events.handlers", "_log_handlers"),  # name -> handler
    "metrics": ("torch.distributed.elastic.metrics", None),
    "LocalElasticAgent": (_AGENT + ".local_elastic_agent", "LocalElasticAgent"),
    "RunResult": (_AGENT + ".api", "RunResult"),
    "Worker": (_AGENT + ".api", "Worker"),
    "WorkerGroup": (_AGENT + ".api", "WorkerGroup"),
    "WorkerSpec": (_AGENT + ".api", "WorkerSpec"),
    "WorkerState": (_AGENT + ".api", "WorkerState"),
    # processes, logs, errors
    "DefaultLogsSpecs": (_MP, "DefaultLogsSpecs"),
    "LogsSpecs": (_MP, "LogsSpecs"),
    "PContext": (_MP, "PContext"),
    "SignalException": (_MP, "SignalException"),
    "Std": (_MP, "Std"),
    "start_processes": (_MP, "start_processes"),
    "RunProcsResult": (_MP + ".api", "RunProcsResult"),
    "to_map": (_MP + ".api", "to_map"),
    "ChildFailedError": (_MP + ".errors", "ChildFailedError"),
    "ProcessFailure": (_MP + ".errors", "ProcessFailure"),
    "record": (_MP + ".errors", "record"),
    # rendezvous: from the ``api`` submodule, complete before the package
    # __init__ loads the entry points (our rendezvous module among them)
    "RendezvousHandler": (_R + ".api", "RendezvousHandler"),
    "RendezvousInfo": (_R + ".api", "RendezvousInfo"),
    "RendezvousParameters": (_R + ".api", "RendezvousParameters"),
    "RendezvousStoreInfo": (_R + ".api", "RendezvousStoreInfo"),
    "rendezvous_handler_registry": (_R + ".api", "rendezvous_handler_registry"),
    "create_dynamic_handler": (_R + ".dynamic_rendezvous", "create_handler"),
    "create_c10d_backend": (_R + ".c10d_rendezvous_backend", "create_backend"),
    # the default process group's store (the re-balancer's word to benched ranks)
    "default_store": ("torch.distributed.distributed_c10d", "_get_default_store"),
}


def __getattr__(name: str):
    try:
        module_name, attr = _LATE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None

    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


# --- what older torchelastic releases lack -----------------------------------
# Fields and arguments added after 2.4: event_log_handler (2.8), numa_options
# (2.9), signals_to_handle, duplicate_std{out,err}_filters, virtual_local_rank
# (2.10), shutdown_timeout (2.12). On a release without one, it is unset.


def launch_option(config, name: str, default=None):
    """``config.<name>`` of a ``LaunchConfig``, or ``default`` where this torch has no such field."""
    return getattr(config, name, default)


def call_supported(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` without the keyword arguments this torch's ``fn`` does not take.

    A dropped argument must be unset (None): a value this torch cannot honour is
    a one-line error naming the torch release, never silently ignored.
    """
    import inspect

    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for name in [n for n in kwargs if n not in params]:
            if kwargs.pop(name) is not None:
                import torch

                from kaitian.errors import UsageError

                raise UsageError(f"{name} needs a newer torch than {torch.__version__} (its torchelastic has no such option)")
    return fn(*args, **kwargs)


# --- kaitian's launch_agent against torch's -----------------------------------
# kaitian/launcher/launch.py::launch_agent is torch.distributed.launcher.api.launch_agent
# (same steps: run id, rendezvous parameters, static master address, worker spec, metrics,
# agent.run, ChildFailedError, a signalled agent leaves the rendezvous open, finally the
# rendezvous shut down) but for these differences. torch's cannot be called: it builds
# LocalElasticAgent itself.
LAUNCH_AGENT_DIFFERENCES = (
    "the agent is KaitianAgent(spec, config, request, monitor), not LocalElasticAgent",
    "the rendezvous handler is wrapped in KaitianRendezvousHandler, which leaves ranks to the agent",
    "WorkerSpec and the agent get only the arguments this torch takes (call_supported)",
    "WorkerSpec gets no numa_options: each worker's cores come from its own device (kaitian.devices.numa), "
    "where torch binds local rank i to CUDA device i's NUMA node",
    "TORCHELASTIC_SIGNALS_TO_HANDLE is set only by a torch whose LaunchConfig has signals_to_handle",
    "no health_check_server argument and no early health-check server (torch 2.13+: an internal knob)",
    "torch's 'Starting elastic_operator' log of the config is not repeated",
    "a rendezvous closed gracefully (agent.run() -> None) returns {}",
    "finally: the runtime and the --monitor are shut down after the rendezvous",
)
# torch's launch_agent parameters and LaunchConfig fields (2.4 to 2.15: each release has a
# subset) that kaitian's launch_agent passes on or leaves out as listed above.
LAUNCH_AGENT_PARAMETERS = ("config", "entrypoint", "args", "health_check_server")
LAUNCH_CONFIG_FIELDS = frozenset({
    "min_nodes", "max_nodes", "nproc_per_node", "logs_specs", "run_id", "role", "rdzv_endpoint", "rdzv_backend",
    "rdzv_configs", "rdzv_timeout", "max_restarts", "monitor_interval", "start_method", "log_line_prefix_template",
    "metrics_cfg", "local_addr", "event_log_handler", "numa_options", "signals_to_handle",
    "duplicate_stdout_filters", "duplicate_stderr_filters", "virtual_local_rank", "shutdown_timeout",
})


def launch_agent_drift() -> list:
    """What this torch's ``launch_agent`` takes that kaitian's does not account for:
    a new parameter or a new ``LaunchConfig`` field (empty: none).

    A test fails on it for every torch CI runs, so a release that changes torch's
    launch is read before kaitian's drifts from it (as it once did: the
    health-check server argument).
    """
    import dataclasses
    import inspect

    api = importlib.import_module("torch.distributed.launcher.api")
    params = [p for p in inspect.signature(api.launch_agent).parameters if p not in LAUNCH_AGENT_PARAMETERS]
    fields = sorted({f.name for f in dataclasses.fields(api.LaunchConfig)} - LAUNCH_CONFIG_FIELDS)
    return [f"launch_agent({p}=...)" for p in params] + [f"LaunchConfig.{f}" for f in fields]


def _method_name(depth: int = 2) -> str:
    """``dynamic_rendezvous.get_method_name`` without ``inspect.stack()``.

    torch computes a caller's name for every rendezvous event record with two
    full ``inspect.stack()`` calls (each reads the source of every frame and
    scans ``sys.modules``), even when no event handler is installed: about a
    second of agent start-up on a small machine. The frame's code name is the
    same value.
    """
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def speed_up_rendezvous_events() -> None:
    """Installs :func:`_method_name` in torch's dynamic rendezvous (idempotent)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = _method_name


def rendezvous_backend_names() -> list:
    """Names registered with torchelastic's rendezvous registry (entry points included).

    Importing the rendezvous package runs its ``__init__``, which registers
    torch's backends and the ``torchrun.handlers`` plug-ins.
    """
    import torch.distributed.elastic.rendezvous  # noqa: F401

    return sorted(__getattr__("rendezvous_handler_registry")._registry)  # noqa: SLF001


def get_rendezvous_handler(params):
    """torchelastic's registry lookup (imported late: the registry module imports plug-ins)."""
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler as _get

    return _get(params)


@contextlib.contextmanager
def workers_started_by(start) -> Iterator[None]:
    """Within the block, ``LocalElasticAgent._start_workers`` hands the worker
    processes it would start to ``start`` and keeps what it returns as its
    process context.

    Every release from 2.4 to 2.15 builds the workers' torchrun arguments and
    environments in ``_start_workers`` and passes them to its module's
    ``start_processes`` (by keyword, as ``start`` gets them); no method between
    the two can be overridden. So kaitian's agent keeps torch's environment,
    whatever the release, and starts the processes where it wants.

    Raises:
        RuntimeError: ``_start_workers`` did not call it (a torch that starts workers another way).
    """
    from torch.distributed.elastic.agent.server import local_elastic_agent as module

    calls = []

    def handed_over(**kwargs):
        calls.append(1)
        return start(**kwargs)

    original, module.start_processes = module.start_processes, handed_over
    try:
        yield
    finally:
        module.start_processes = original
    if not calls:
        import torch

        raise RuntimeError(f"torch {torch.__version__}'s LocalElasticAgent started its workers without "
                           "start_processes; kaitian/_torch.py must follow it")


def close_local_agent(shutdown, death_sig, timeout: int) -> None:
    """``LocalElasticAgent._shutdown`` (bound): stops the watchdog and the health
    check and closes the workers' process context, SIGKILL after ``timeout``.

    torch 2.4's takes ``is_restart`` instead of ``timeout`` (it closes in 30 s,
    and it has no ``--shutdown-timeout``) and, unless restarting, also shuts the
    rendezvous down, which kaitian's ``launch_agent`` does (and, as torch's own
    ``launch_agent``, not for a signalled agent, whose peers go on).
    """
    import inspect

    params = inspect.signature(shutdown).parameters
    if "timeout" in params:
        shutdown(death_sig, timeout=timeout)
    elif "is_restart" in params:
        shutdown(death_sig, is_restart=True)
    else:
        shutdown(death_sig)


def subprocess_exit_codes(pcontext) -> dict:
    """Each process's exit code in a ``SubprocessContext`` (``None`` while it runs),
    read from its handler without ``wait()``, which stops the others once one failed."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if handlers is None:
        from kaitian.errors import UsageError

        raise UsageError(
            "--on-failure continue watches worker processes one by one; it runs scripts "
            "(kaitianrun script.py), not function entrypoints"
        )
    return {key: handler.proc.poll() for key, handler in handlers.items()}


# --- torch.distributed's backend registry and autograd engine -----------------


def backend_plugins() -> dict:
    """torch's registry of plug-in backends: ``{"NAME": plugin}`` (``creator_fn``, ``extended_api``)."""
    import torch.distributed as dist

    return getattr(dist.Backend, "_plugins", {})


def backend_options(store, group_rank: int, group_size: int, timeout):
    """The options object an ``extended_api`` backend creator receives."""
    from torch.distributed import distributed_c10d

    opts = distributed_c10d._DistributedBackendOptions()
    opts.store, opts.group_rank, opts.group_size, opts.timeout = store, group_rank, group_size, timeout
    return opts


def vendor_options(opts, timeout, global_ranks=(), group_name: str = ""):
    """A vendor process group's ``Options`` (NCCL's, torch_mlu's CNCL's) with the
    group's timeout, and its world ranks and name where the options carry them
    (the vendor's logs, flight recorder and watchdog name the group by them)."""
    opts._timeout = timeout
    if hasattr(opts, "global_ranks_in_group"):
        opts.global_ranks_in_group = list(global_ranks)
    if hasattr(opts, "group_name"):
        opts.group_name = group_name
    return opts


def nccl_connect_now(pg, device) -> None:
    """Creates the communicator now (as ``init_process_group(device_id=...)``
    does), not lazily inside the first reduction on kaitian's progress thread."""
    pg.eager_connect_single_device(device)


def abort_process_groups() -> None:
    """Aborts every process group and forgets them (torch's path to recover from a failure:
    vendor communicators are aborted, not destroyed); torch without it destroys them."""
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
    else:
        distributed_c10d.destroy_process_group()


def current_graph_task() -> int:
    """The id of the backward pass running on this thread (-1 outside one): forwards whose outputs get
    their gradient in the same pass are one batch's."""
    import torch

    return torch._C._current_graph_task_id()


def queue_autograd_callback(callback) -> None:
    """Runs ``callback`` when the current backward pass finishes (as torch's DDP does)."""
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


# The names in _LATE are attributes too (resolved on first use).
__all__ = [
    "ChildFailedError",
    "LocalElasticAgent",
    "abort_process_groups",
    "check_env",
    "env",
    "backend_options",
    "backend_plugins",
    "call_supported",
    "close_local_agent",
    "launch_option",
    "launch_agent_drift",
    "LAUNCH_AGENT_DIFFERENCES",
    "nccl_connect_now",
    "vendor_options",
    "queue_autograd_callback",
    "DefaultLogsSpecs",
    "LogsSpecs",
    "PContext",
    "ProcessFailure",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStoreInfo",
    "RunProcsResult",
    "RunResult",
    "RUN_SCRIPT_PATH_CODE",
    "SUPPORTED_TORCH",
    "SignalException",
    "Std",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "create_c10d_backend",
    "create_dynamic_handler",
    "events",
    "get_rendezvous_handler",
    "is_run_script_path",
    "metrics",
    "record",
    "rendezvous_backend_names",
    "rendezvous_handler_registry",
    "set_thread_name",
    "speed_up_rendezvous_events",
    "start_processes",
    "subprocess_exit_codes",
    "to_map",
    "workers_started_by",
]

# Last, with _LATE and __getattr__ in place: torch's rendezvous package loads
# the torchrun.handlers entry points (kaitian.launcher.rendezvous among them)
# when it is first imported. That must happen here, before any kaitian module
# that resolves a rendezvous name starts importing, or the entry point would
# find that module half-imported.
import torch.distributed.elastic.rendezvous  # noqa: E402,F401
