"""The ``kaitian`` command: a thin dispatcher to each piece's own ``main``.

Subcommands are imported lazily so ``kaitian devices`` does not pay for the
benchmarks' imports.
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

__all__ = ["main"]

# command words -> "module:function"; each function takes argv and returns an exit code.
COMMANDS = {
    ("devices",): ("kaitian.commands.devices:main", "print this host's device inventory"),
    ("init",): ("kaitian.commands.init:main", "measure each device's capability and write the config"),
    ("run",): ("kaitian.launcher.cli:run_alias", "alias of the original `kaitian run -f script.py`"),
    ("bench", "collectives"): ("kaitian.bench.collectives:main", "kaitian vs gloo collectives"),
    ("bench", "launch"): ("kaitian.bench.launch:main", "kaitianrun vs torchrun start-up and recovery"),
    ("bench", "docker"): ("kaitian.bench.docker:main", "docker runtime vs local runtime"),
    ("bench", "hetero"): ("kaitian.bench.hetero:main", "equal vs capability vs re-balanced split"),
    ("bench", "recovery"): ("kaitian.bench.recovery:main", "a lost worker: --on-failure continue vs restarts"),
    ("images", "build"): ("kaitian.commands.images:main", "build the vendor container images"),
}


def _usage() -> str:
    lines = ["usage: kaitian COMMAND [ARGS...]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<20} {help_text}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    for words, (target, _) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(words)]) == words:
            module_name, func_name = target.split(":")
            func = getattr(importlib.import_module(module_name), func_name)
            return int(func(argv[len(words):]) or 0)
    print(f"kaitian: unknown command {' '.join(argv[:2])!r}; run `kaitian --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
