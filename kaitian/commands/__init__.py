"""The ``kaitian`` command: a thin dispatcher to each piece's own ``main``.

Subcommands are imported lazily so ``kaitian devices`` does not pay for the
benchmarks' imports.
"""

from __future__ import annotations

import importlib
import os
import signal
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


class _Stopped(BaseException):
    """SIGTERM or SIGHUP, raised where the command is (as Ctrl-C's KeyboardInterrupt), so that its
    cleanup runs: a benchmark stops the job it started in a session of its own and removes its folder."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def _run(func, argv: List[str]) -> int:
    """``func(argv)``; stopped by a signal, it ends by that signal once its cleanup ran, as Python ends on
    Ctrl-C (a signal the caller ignores, nohup's SIGHUP say, stays ignored)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _raise_stopped)
    try:
        return int(func(argv) or 0)
    except (KeyboardInterrupt, _Stopped) as stop:
        signum = stop.signum if isinstance(stop, _Stopped) else signal.SIGINT
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum  # (not reached: the signal ends the process)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    for words, (target, _) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(words)]) == words:
            module_name, func_name = target.split(":")
            func = getattr(importlib.import_module(module_name), func_name)
            return _run(func, argv[len(words):])
    print(f"kaitian: unknown command {' '.join(argv[:2])!r}; run `kaitian --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
