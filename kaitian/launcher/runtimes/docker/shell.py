"""The shell snippets kaitian runs inside containers (POSIX ``sh`` only, so any image works).

- ``MAIN_TIED``: the main process of a run's container. It reads its stdin,
  which the agent holds through an attach; when the agent exits, however it
  dies, the engine closes that stdin, the loop ends, the container stops, the
  kernel kills every worker in its pid namespace, and the engine removes it.
- ``MAIN_KEPT``: the main process of a ``--keep-containers`` container, which
  must outlive its agent.
- ``WRAPPER_SCRIPT``: what ``docker exec`` runs for every worker.
- ``stop_command``: signals worker process groups from inside the container.
"""

from __future__ import annotations

import shlex
from typing import Iterable, Tuple

__all__ = ["MAIN_TIED", "MAIN_KEPT", "WRAPPER_SCRIPT", "stop_command"]

MAIN_TIED = ("sh", "-c", "while read -r _; do :; done")
MAIN_KEPT = ("sleep", "infinity")

# Records the worker's in-container pid (which is also its process group: a
# docker exec starts a new session; where a runtime does not, setsid makes one
# without forking), sends its output straight to its log files when it has
# them (the Engine's exec stream can drop the last lines of a process that
# exits: a crashed worker's traceback), pins it to its slot's cores, then
# becomes the worker itself so the exec's exit code is the worker's.
WRAPPER_SCRIPT = (
    'pidfile=$0; cpus=$1; out=$2; err=$3; shift 3; '
    'read -r _ _ _ _ pgrp _ < /proc/$$/stat; '
    'echo $$ > "$pidfile.tmp" && mv "$pidfile.tmp" "$pidfile"; '
    'if [ -n "$out" ]; then exec >>"$out"; fi; '
    'if [ -n "$err" ]; then exec 2>>"$err"; fi; '
    'if [ -n "$cpus" ] && command -v taskset >/dev/null 2>&1; then set -- taskset -c "$cpus" "$@"; fi; '
    'if [ "$pgrp" != "$$" ]; then set -- setsid "$@"; fi; '
    'exec "$@"'
)


def stop_command(pgids: Iterable[int], sig_name: str) -> Tuple[str, ...]:
    """The in-container command that signals whole worker process groups.

    ``kill`` may fail for groups that are already gone; the others still get
    the signal, so the exit status is ignored (``|| true`` per group).
    """
    sig = sig_name[3:] if sig_name.startswith("SIG") else sig_name
    parts = [f"kill -s {shlex.quote(sig)} -- -{int(p)} 2>/dev/null || true" for p in pgids]
    return ("sh", "-c", "; ".join(parts) or "true")
