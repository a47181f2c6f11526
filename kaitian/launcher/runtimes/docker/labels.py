"""Container and image labels, and the agent identity they record.

Every container the docker runtime creates carries ``org.kaitian.*`` labels:
its run, vendor group, shape (``spec``) and owning agent (host, pid, process
start time), so a later agent tells a live owner from a dead one without any
state outside the engine.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

__all__ = [
    "LABEL_PREFIX",
    "LABEL_MANAGED",
    "LABEL_RUN_ID",
    "LABEL_VENDOR",
    "LABEL_GROUP",
    "LABEL_AGENT_HOST",
    "LABEL_AGENT_PID",
    "LABEL_AGENT_START",
    "LABEL_KEEP",
    "LABEL_SPEC",
    "LABEL_HOST_MOUNTS",
    "LABEL_PYTHON",
    "AgentIdentity",
    "agent_identity",
    "owner_alive",
    "label_filters",
]

LABEL_PREFIX = "org.kaitian"
LABEL_MANAGED = f"{LABEL_PREFIX}.managed"
LABEL_RUN_ID = f"{LABEL_PREFIX}.run-id"
LABEL_VENDOR = f"{LABEL_PREFIX}.vendor"
LABEL_GROUP = f"{LABEL_PREFIX}.group"
LABEL_AGENT_HOST = f"{LABEL_PREFIX}.agent-host"
LABEL_AGENT_PID = f"{LABEL_PREFIX}.agent-pid"
LABEL_AGENT_START = f"{LABEL_PREFIX}.agent-start"
LABEL_KEEP = f"{LABEL_PREFIX}.keep"
LABEL_SPEC = f"{LABEL_PREFIX}.spec"
# Image labels (set by `kaitian images build`): host paths an image needs
# bind-mounted at the same path (the host-Python test image), and its python.
LABEL_HOST_MOUNTS = f"{LABEL_PREFIX}.host-mounts"
LABEL_PYTHON = f"{LABEL_PREFIX}.python"


@dataclass(frozen=True)
class AgentIdentity:
    """The agent that owns a container, to tell live owners from dead ones.

    Attributes:
        host: the agent's host name.
        pid: the agent's process id.
        start: the agent process's start time (clock ticks since boot), so a
            recycled pid is not mistaken for the agent.
    """

    host: str
    pid: int
    start: str


def _process_start(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot), or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name may hold spaces; fields after the last ')' are fixed.
    return stat.rsplit(")", 1)[1].split()[19]


def agent_identity() -> AgentIdentity:
    """This agent's host, pid and process start time (labels its containers)."""
    pid = os.getpid()
    return AgentIdentity(host=socket.gethostname(), pid=pid, start=_process_start(pid) or "0")


def owner_alive(labels: Mapping[str, str]) -> bool:
    """Whether the agent named in a container's labels still runs on this host."""
    try:
        pid = int(labels.get(LABEL_AGENT_PID, ""))
    except ValueError:
        return False
    start = _process_start(pid)
    return start is not None and start == labels.get(LABEL_AGENT_START)


def label_filters(labels: Mapping[str, str]) -> Dict[str, List[str]]:
    """The Engine's ``filters`` argument matching every one of ``labels``."""
    return {"label": [f"{k}={v}" for k, v in labels.items()]}
