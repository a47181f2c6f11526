"""Worker runtimes: ``local`` (default) and ``docker``."""

from __future__ import annotations

import importlib

from kaitian.launcher.runtimes.base import RunContext, Runtime, WorkerLaunch
from kaitian.launcher.runtimes.options import LocalOptions, RuntimeOptions, options_from_args

__all__ = [
    "RUNTIMES", "get_runtime", "runtime_class", "Runtime", "RunContext", "WorkerLaunch",
    "RuntimeOptions", "LocalOptions", "options_from_args",
]

# name -> "module:class", imported on use so the docker SDK loads only when asked for.
RUNTIMES = {
    "local": "kaitian.launcher.runtimes.local:LocalRuntime",
    "docker": "kaitian.launcher.runtimes.docker.runtime:DockerRuntime",
}


def runtime_class(name: str) -> type:
    """The ``Runtime`` subclass registered as ``name``.

    Raises:
        ValueError: no runtime of that name.
    """
    try:
        module_name, cls_name = RUNTIMES[name].split(":")
    except KeyError:
        raise ValueError(f"unknown runtime {name!r}; choose one of: {', '.join(RUNTIMES)}") from None
    return getattr(importlib.import_module(module_name), cls_name)


def get_runtime(name: str, ctx: RunContext) -> Runtime:
    """Builds the runtime ``name`` for this node's run."""
    return runtime_class(name)(ctx)
