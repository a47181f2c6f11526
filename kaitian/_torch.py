"""Every torch-private ``torch.distributed.elastic`` / ``torch.distributed.run`` name kaitian uses.

kaitianrun is built on torchelastic without forking its files. The names below
are not all part of torch's stable API, so they are imported here and nowhere
else: a torch upgrade that moves one of them touches this file only.

Import note: torch imports ``kaitian.launcher.rendezvous`` (through the
``torchrun.handlers`` entry point) while ``torch.distributed.elastic.rendezvous``
is still initialising; every name imported below already exists at that point.
"""

from __future__ import annotations

import sys

# --- torchrun's command line -------------------------------------------------
from torch.multiprocessing import _set_thread_name as set_thread_name  # noqa: F401

# torch.distributed.run and torch.distributed.launcher.api are resolved on first
# use (module __getattr__ below): under plain torchrun this module is imported
# by the torchrun.handlers entry point while those two are half-initialised.
_LATE = {
    "config_from_args": ("torch.distributed.run", "config_from_args"),
    "get_args_parser": ("torch.distributed.run", "get_args_parser"),
    "parse_min_max_nnodes": ("torch.distributed.run", "parse_min_max_nnodes"),
    "LaunchConfig": ("torch.distributed.launcher.api", "LaunchConfig"),
    "get_addr_and_port": ("torch.distributed.launcher.api", "_get_addr_and_port"),
    "get_entrypoint_name": ("torch.distributed.launcher.api", "_get_entrypoint_name"),
    # Needed by kaitian.launcher.rendezvous at import time. When this module
    # imports the agent below, torch initialises its rendezvous package, which
    # loads our entry point while this module is still half-imported; the
    # rendezvous ``api`` submodule is complete by then, so resolve from it.
    "RendezvousHandler": ("torch.distributed.elastic.rendezvous.api", "RendezvousHandler"),
    "rendezvous_handler_registry": ("torch.distributed.elastic.rendezvous.api", "rendezvous_handler_registry"),
}


def __getattr__(name: str):
    try:
        module_name, attr = _LATE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


# --- the agent ---------------------------------------------------------------
from torch.distributed.elastic import events, metrics, timer  # noqa: F401
from torch.distributed.elastic.agent.server.api import (  # noqa: F401
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import (  # noqa: F401
    TORCHELASTIC_ENABLE_FILE_TIMER,
    TORCHELASTIC_HEALTH_CHECK_PORT,
    TORCHELASTIC_TIMER_FILE,
)
from torch.distributed.elastic.agent.server.health_check_server import (  # noqa: F401
    create_healthcheck_server,
)
from torch.distributed.elastic.utils import macros  # noqa: F401

# --- processes, logs, errors -------------------------------------------------
from torch.distributed.elastic.multiprocessing import (  # noqa: F401
    DefaultLogsSpecs,
    LogsSpecs,
    PContext,
    SignalException,
    Std,
    start_processes,
)
from torch.distributed.elastic.multiprocessing.api import RunProcsResult, to_map  # noqa: F401
from torch.distributed.elastic.multiprocessing.errors import (  # noqa: F401
    ChildFailedError,
    ProcessFailure,
    record,
)

# --- rendezvous --------------------------------------------------------------
from torch.distributed.elastic.rendezvous.api import (  # noqa: F401
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: F401
    create_handler as create_dynamic_handler,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (  # noqa: F401
    create_backend as create_c10d_backend,
)


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

    Importing ``rendezvous.api`` above ran the package's ``__init__``, which
    registered torch's backends and the ``torchrun.handlers`` plug-ins.
    """
    return sorted(rendezvous_handler_registry._registry)  # noqa: SLF001


def get_rendezvous_handler(params: "RendezvousParameters") -> "RendezvousHandler":
    """torchelastic's registry lookup (imported late: the registry module imports plug-ins)."""
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler as _get

    return _get(params)


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


def nccl_options(timeout):
    """``ProcessGroupNCCL.Options`` with the group's timeout."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def queue_autograd_callback(callback) -> None:
    """Runs ``callback`` when the current backward pass finishes (as torch's DDP does)."""
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


# The names in _LATE are attributes too (resolved on first use).
__all__ = [
    "ChildFailedError",
    "backend_options",
    "backend_plugins",
    "nccl_options",
    "queue_autograd_callback",
    "DefaultLogsSpecs",
    "LogsSpecs",
    "PContext",
    "ProcessFailure",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStoreInfo",
    "RunProcsResult",
    "RunResult",
    "SignalException",
    "SimpleElasticAgent",
    "Std",
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
    "TORCHELASTIC_TIMER_FILE",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "create_c10d_backend",
    "create_dynamic_handler",
    "create_healthcheck_server",
    "events",
    "get_rendezvous_handler",
    "macros",
    "metrics",
    "record",
    "rendezvous_backend_names",
    "rendezvous_handler_registry",
    "set_thread_name",
    "speed_up_rendezvous_events",
    "start_processes",
    "timer",
    "to_map",
]
