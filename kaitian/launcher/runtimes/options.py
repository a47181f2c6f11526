"""Typed runtime options: built once from kaitianrun's flags, read by the runtimes.

Every runtime flag is checked here before anything starts (a bad value is a
one-line error), whichever runtime was chosen, so ``--image x`` is refused
the same way with ``--runtime local``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import List, Optional

from kaitian.launcher.runtimes.docker.options import DockerOptions

__all__ = ["LocalOptions", "RuntimeOptions", "DockerOptions", "options_from_args"]


@dataclass(frozen=True)
class LocalOptions:
    """Options only the local runtime uses.

    Attributes:
        numa_options: torchrun's ``--numa-binding`` (a torch ``NumaOptions``), or ``None``.
    """

    numa_options: Optional[object] = None


@dataclass(frozen=True)
class RuntimeOptions:
    """Every runtime option of one run.

    Attributes:
        duplicate_stdout_filters: torchrun's ``--duplicate-stdout-filters`` (both runtimes).
        duplicate_stderr_filters: torchrun's ``--duplicate-stderr-filters`` (both runtimes).
        local: the local runtime's options.
        docker: the docker runtime's options.
    """

    duplicate_stdout_filters: Optional[List[str]] = None
    duplicate_stderr_filters: Optional[List[str]] = None
    local: LocalOptions = field(default_factory=LocalOptions)
    docker: DockerOptions = field(default_factory=DockerOptions)


def options_from_args(args: argparse.Namespace, config: object) -> RuntimeOptions:
    """The run's options from kaitianrun's parsed flags and torchrun's launch config.

    Raises:
        DockerOptionError: a docker flag that cannot be used.
    """
    return RuntimeOptions(
        duplicate_stdout_filters=getattr(config, "duplicate_stdout_filters", None),
        duplicate_stderr_filters=getattr(config, "duplicate_stderr_filters", None),
        local=LocalOptions(numa_options=getattr(config, "numa_options", None)),
        docker=DockerOptions.from_flags(
            images=args.image,
            keep_containers=args.keep_containers,
            volumes=args.volume,
            shm_size=args.shm_size,
            container_user=args.container_user,
        ),
    )
