"""``python -I -S .../die_with_agent.py AGENT_PID PROGRAM ARGS...``

Ties a local worker's life to its agent, then becomes the worker (``execv``
keeps the pid torch watches): the kernel sends SIGKILL to the worker when the
agent dies, even a SIGKILLed agent, in every quota mode (SIGKILL also ends a
process the duty cycle left stopped). A parent-death signal survives ``exec``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list) -> None:
    agent_pid, program = int(argv[0]), argv[1]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != agent_pid:  # the agent died before the signal was armed
        os._exit(1)
    os.execv(program, [program, *argv[2:]])


if __name__ == "__main__":
    main(sys.argv[1:])
