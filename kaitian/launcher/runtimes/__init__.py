"""Worker runtimes: ``local`` (default) and ``docker``."""

from __future__ import annotations

import argparse
import importlib

from kaitian.launcher.runtimes.base import RunContext, Runtime, WorkerStart
from kaitian.launcher.runtimes.options import RuntimeOptions

__all__ = [
    "RUNTIMES", "RUNTIME_OPTIONS", "get_runtime", "runtime_class", "Runtime", "RunContext", "WorkerStart", "RuntimeOptions", "options_from_args",
]

# name -> "module:class", imported on use so the docker SDK loads only when asked for.
RUNTIMES = {
    "local": "kaitian.launcher.runtimes.local:LocalRuntime",
    "docker": "kaitian.launcher.runtimes.docker.runtime:DockerRuntime",
}
# name -> the runtime's own options class (``from_args(args, config)``), in a
# module that loads without the runtime itself.
RUNTIME_OPTIONS = {
    "docker": "kaitian.launcher.runtimes.docker.options:DockerOptions",
}


def _load(spec: str) -> type:
    module_name, cls_name = spec.split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def runtime_class(name: str) -> type:
    """The ``Runtime`` subclass registered as ``name``.

    Raises:
        ValueError: no runtime of that name.
    """
    try:
        spec = RUNTIMES[name]
    except KeyError:
        raise ValueError(f"unknown runtime {name!r}; choose one of: {', '.join(RUNTIMES)}") from None
    return _load(spec)


def options_from_args(args: argparse.Namespace, config: object) -> RuntimeOptions:
    """The run's options from kaitianrun's parsed flags and torchrun's launch
    config: every runtime's own options checked, whichever runtime was chosen.

    Raises:
        DockerOptionError: a docker flag that cannot be used.
    """
    return RuntimeOptions(
        duplicate_stdout_filters=getattr(config, "duplicate_stdout_filters", None),
        duplicate_stderr_filters=getattr(config, "duplicate_stderr_filters", None),
        own={name: _load(spec).from_args(args, config) for name, spec in RUNTIME_OPTIONS.items()},
    )


def get_runtime(name: str, ctx: RunContext) -> Runtime:
    """Builds the runtime ``name`` for this node's run."""
    return runtime_class(name)(ctx)
