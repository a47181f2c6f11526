"""What the docker runtime will do, decided without touching a daemon.

The docker runtime is split in two (as torchx's docker scheduler is): this
module turns a run's workers and options into plain dataclasses describing one
container per kaitian group and one ``docker exec`` per worker; ``docker.py``
carries them out with the docker SDK. Everything here is pure, so it is unit
tested without an engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from kaitian.devices.container import container_devices
from kaitian.devices.inventory import format_cpulist
from kaitian.devices.vendors import VENDORS
from kaitian.errors import (
    ContainerLookupError, DockerOptionError, DockerRuntimeError, DockerUnavailableError, ImageNotFoundError,
)

__all__ = [
    "DockerRuntimeError",
    "DockerOptionError",
    "DockerUnavailableError",
    "ImageNotFoundError",
    "ContainerLookupError",
    "AgentIdentity",
    "Mount",
    "ContainerPlan",
    "ExecPlan",
    "DockerOptions",
    "LABEL_PREFIX",
    "LABEL_HOST_MOUNTS",
    "LABEL_PYTHON",
    "WRAPPER_SCRIPT",
    "parse_volume",
    "parse_options",
    "image_for",
    "plan_container",
    "plan_exec",
    "worker_env",
    "stop_command",
    "exit_code_from_docker",
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

# The idle main process of a container; workers arrive through `docker exec`.
IDLE_COMMAND = ("sleep", "infinity")

# Run by `docker exec` for every worker: records the worker's in-container pid
# (which is also its process group: a docker exec starts a new session; where a
# runtime does not, setsid makes one without forking), pins it to its slot's
# cores, then becomes the worker itself so the exec's exit code is the worker's.
WRAPPER_SCRIPT = (
    'pidfile=$0; cpus=$1; shift; '
    'read -r _ _ _ _ pgrp _ < /proc/$$/stat; '
    'echo $$ > "$pidfile.tmp" && mv "$pidfile.tmp" "$pidfile"; '
    'if [ -n "$cpus" ] && command -v taskset >/dev/null 2>&1; then set -- taskset -c "$cpus" "$@"; fi; '
    'if [ "$pgrp" != "$$" ]; then set -- setsid "$@"; fi; '
    'exec "$@"'
)

# Host variables that describe the host's software, not the job: the image has
# its own (its PATH, its libraries, its Python).
_HOST_ONLY_ENV = frozenset(
    {
        "PATH", "HOME", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM",
        "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHOME", "PYTHONEXECUTABLE",
        "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_EXE",
        "CONDA_PYTHON_EXE", "CONDA_SHLVL", "PYENV_VERSION", "PYENV_DIR",
        "PYENV_ROOT", "PYENV_HOOK_PATH", "PYENV_SHELL",
    }
)

_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")


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


@dataclass(frozen=True)
class Mount:
    """A bind mount ``source`` (host) -> ``target`` (container)."""

    source: str
    target: str
    read_only: bool = False

    def to_docker(self) -> Dict[str, object]:
        """The docker SDK's ``Mount`` keyword arguments."""
        return {"type": "bind", "source": self.source, "target": self.target, "read_only": self.read_only}


@dataclass(frozen=True)
class DockerOptions:
    """The docker options of ``RunContext.options``, checked.

    Attributes:
        images: image per group or vendor name (``--image cuda=repo:tag``).
        keep_containers: leave containers running after the run for reuse.
        volumes: extra bind mounts (``-v host:container[:ro]``).
        shm_size: size of the containers' ``/dev/shm`` (``--shm-size``).
    """

    images: Mapping[str, str] = field(default_factory=dict)
    keep_containers: bool = False
    volumes: Tuple[Mount, ...] = ()
    shm_size: str = "2g"


@dataclass(frozen=True)
class ContainerPlan:
    """One long-lived container for one kaitian group on this node.

    Attributes:
        name: container name.
        image: image reference.
        group: kaitian group (``KAITIAN_GROUP``) whose workers run inside.
        vendor: the group's device type.
        labels: container labels (run id, vendor, group, owner, spec hash).
        mounts: bind mounts, host paths at identical container paths.
        devices: device nodes (``host:container:rwm``), e.g. Cambricon's.
        gpu_ids: host GPU indices passed as an NVIDIA device request.
        cpuset: ``cpuset-cpus`` of the container (``None``: all cores).
        cpu_quota: CPU time the container may use, in cores (``None``: no limit).
        cpu_shares: CPU weight: 1024 per worker, so under contention the
            group's workers weigh what as many local processes would.
        cgroup_parent: cgroup to create the container's cgroup in (``None``:
            the engine's default); see ``plan_container``.
        shm_size: ``--shm-size``.
        index_map: host device index -> index seen inside the container.
        device_env: what every worker inside needs to see its devices
            (:func:`kaitian.devices.container.container_devices`).
        spec: hash of everything above that shapes the container, so a
            container is reused only when it matches.
    """

    name: str
    image: str
    group: str
    vendor: str
    labels: Mapping[str, str]
    mounts: Tuple[Mount, ...]
    devices: Tuple[str, ...] = ()
    gpu_ids: Tuple[str, ...] = ()
    cpuset: Optional[str] = None
    cpu_quota: Optional[float] = None
    cpu_shares: int = 1024
    cgroup_parent: Optional[str] = None
    shm_size: str = "2g"
    index_map: Mapping[int, int] = field(default_factory=dict)
    device_env: Mapping[str, str] = field(default_factory=dict)
    spec: str = ""

    CPU_PERIOD_US = 100_000

    def create_kwargs(self) -> Dict[str, object]:
        """Keyword arguments for ``client.containers.create`` (docker SDK).

        Host network and IPC so the shared-memory bridge and the rendezvous work
        across containers exactly as between local processes; never privileged.
        """
        kwargs: Dict[str, object] = {
            "image": self.image,
            "command": list(IDLE_COMMAND),
            "name": self.name,
            "labels": dict(self.labels),
            "detach": True,
            "init": True,  # reaps orphans left by exec'd workers
            "network_mode": "host",
            "ipc_mode": "host",
            "shm_size": self.shm_size,
            "privileged": False,
            "mounts": [m.to_docker() for m in self.mounts],
            "devices": list(self.devices),
        }
        if self.gpu_ids:
            kwargs["device_requests"] = [
                {"driver": "nvidia", "device_ids": list(self.gpu_ids), "capabilities": [["gpu"]]}
            ]
        if self.cpuset:
            kwargs["cpuset_cpus"] = self.cpuset
        kwargs["cpu_shares"] = self.cpu_shares
        if self.cgroup_parent:
            kwargs["cgroup_parent"] = self.cgroup_parent
        if self.cpu_quota is not None:
            kwargs["cpu_period"] = self.CPU_PERIOD_US
            kwargs["cpu_quota"] = max(1000, int(round(self.cpu_quota * self.CPU_PERIOD_US)))
        return kwargs

    def describe(self) -> str:
        """One line for logs: name, image, devices, cpuset."""
        parts = [f"{self.name} ({self.image})"]
        if self.gpu_ids:
            parts.append(f"gpus {','.join(self.gpu_ids)}")
        if self.devices:
            parts.append(f"{len(self.devices)} device nodes")
        if self.cpuset:
            parts.append(f"cpuset {self.cpuset}")
        if self.cpu_quota is not None:
            parts.append(f"{self.cpu_quota:g} cores of CPU time")
        return ", ".join(parts)


@dataclass(frozen=True)
class ExecPlan:
    """One worker as a ``docker exec`` into its group's container.

    Attributes:
        local_rank: the worker's local rank.
        group: container group it runs in.
        cmd: the exec's argv (wrapper script, then the worker's argv).
        env: the worker's environment inside the container.
        workdir: working directory (the user's cwd, mounted at the same path).
        user: ``uid:gid`` the worker runs as (the agent's, like a local worker).
        pid_file: host path where the wrapper writes the in-container pid.
    """

    local_rank: int
    group: str
    cmd: Tuple[str, ...]
    env: Mapping[str, str]
    workdir: str
    user: str
    pid_file: str

    def env_list(self) -> List[str]:
        """``KEY=value`` strings, as the Engine API takes them."""
        return [f"{k}={v}" for k, v in self.env.items()]


def parse_volume(spec: str) -> Mount:
    """Parses ``-v HOST:CONTAINER[:ro|rw]`` (``HOST`` alone mounts it at the same path).

    Raises:
        DockerOptionError: malformed spec or a relative host path.
    """
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3:
        raise DockerOptionError(f"--volume {spec!r}: expected HOST_PATH[:CONTAINER_PATH[:ro|rw]]")
    source = parts[0]
    target = parts[1] if len(parts) > 1 and parts[1] else source
    mode = parts[2] if len(parts) > 2 else "rw"
    if mode not in ("ro", "rw"):
        raise DockerOptionError(f"--volume {spec!r}: mode must be 'ro' or 'rw', not {mode!r}")
    source = os.path.abspath(os.path.expanduser(source))
    if not os.path.isabs(target):
        raise DockerOptionError(f"--volume {spec!r}: the container path must be absolute")
    return Mount(source, target, mode == "ro")


_SHM_SIZE = re.compile(r"^\d+(\.\d+)?[bkmgBKMG]?$")


def parse_options(options: Mapping[str, object]) -> DockerOptions:
    """Checks ``RunContext.options`` for the docker runtime.

    Raises:
        DockerOptionError: a value that cannot be used.
    """
    images = dict(options.get("images") or {})  # type: ignore[arg-type]
    for key, ref in images.items():
        if not key or not ref:
            raise DockerOptionError(f"--image {key}={ref}: expected VENDOR_OR_GROUP=IMAGE[:TAG]")
    volumes = tuple(parse_volume(str(v)) for v in (options.get("volumes") or ()))  # type: ignore[union-attr]
    shm_size = str(options.get("shm_size") or "2g")
    if not _SHM_SIZE.match(shm_size):
        raise DockerOptionError(f"--shm-size {shm_size!r}: expected a size such as 2g or 512m")
    return DockerOptions(
        images=images,
        keep_containers=bool(options.get("keep_containers", False)),
        volumes=volumes,
        shm_size=shm_size,
    )


def image_for(group: str, vendor: str, images: Mapping[str, str]) -> str:
    """The image of a group: ``--image GROUP=…``, else ``--image VENDOR=…``, else the vendor table's."""
    if group in images:
        return images[group]
    if vendor in images:
        return images[vendor]
    try:
        return VENDORS[vendor].image
    except KeyError:
        raise DockerOptionError(
            f"no image for device type {vendor!r}: pass --image {vendor}=IMAGE[:TAG]"
        ) from None


def _sanitize(text: str) -> str:
    return _NAME_UNSAFE.sub("-", text).strip("-.") or "x"


def plan_container(
    *,
    group: str,
    workers: Sequence["object"],
    image: str,
    run_id: str,
    run_dir: str,
    cwd: str,
    log_dirs: Iterable[str],
    options: DockerOptions,
    agent: AgentIdentity,
    image_mounts: Iterable[Mount] = (),
    device_nodes: Iterable[str] = (),
    cgroup_parent: Optional[str] = None,
) -> ContainerPlan:
    """Plans the container of one group.

    Args:
        group: the kaitian group.
        workers: the group's ``WorkerLaunch`` entries (same device type).
        image: image reference for the group.
        run_id: the rendezvous run id.
        run_dir: the node's run directory (mounted at the same path).
        cwd: the user's working directory (mounted at the same path).
        log_dirs: host directories where workers write files (error files).
        options: the checked docker options.
        agent: the owning agent.
        image_mounts: host paths the image asks for (``org.kaitian.host-mounts``).
        device_nodes: device nodes present on this host (``/dev/...``).
        cgroup_parent: where the container's cgroup goes. By default the engine
            nests every container under one cgroup (``/docker``) that weighs as
            much as a single process, so on a busy host containerised workers
            get a fraction of the CPU local workers get; the runtime passes the
            agent's own cgroup where the engine allows it, so they compete as
            local workers do.

    Returns:
        The container plan.

    Raises:
        DockerOptionError: the group mixes device types or CPU quotas.
        DeviceSelectionError: a device the container needs is missing on this host.
    """
    vendors = {w.device.type for w in workers}
    if len(vendors) != 1:
        raise DockerOptionError(f"group {group!r} mixes device types {sorted(vendors)}; one vendor per group")
    vendor = vendors.pop()
    seen = container_devices(vendor, [w.device for w in workers], device_nodes)
    gpu_ids = tuple(str(i) for r in seen.device_requests for i in r["device_ids"])  # type: ignore[attr-defined]
    devices = seen.device_nodes
    index_map = dict(seen.index_map)

    all_cpus = [c for w in workers for c in w.cpus]
    # Pin the container only when every worker is pinned; otherwise leave it free.
    cpuset = format_cpulist(all_cpus) if all_cpus and all(w.cpus for w in workers) else None
    quotas = {w.cpu_quota for w in workers}
    cpu_quota = next(iter(quotas)) if len(quotas) == 1 else None
    if len(quotas) > 1:
        raise DockerOptionError(f"group {group!r} has different CPU quotas {sorted(quotas, key=str)}")

    mounts: Dict[str, Mount] = {}
    for m in image_mounts:
        mounts[m.target] = m
    # The run's own directories at identical paths; one inside another is
    # already visible, and dropping it keeps the shape (and so reuse) stable.
    own = sorted({p for p in (cwd, run_dir, *log_dirs) if p and p != os.devnull}, key=len)
    for path in own:
        if not any(path.startswith(m.rstrip("/") + "/") for m in own if m != path):
            mounts[path] = Mount(path, path, False)
    for m in options.volumes:
        mounts[m.target] = m
    ordered_mounts = tuple(mounts[t] for t in sorted(mounts))

    shape = {
        "image": image,
        "vendor": vendor,
        "mounts": [m.to_docker() for m in ordered_mounts],
        "devices": list(devices),
        "gpus": list(gpu_ids),
        "cpuset": cpuset,
        "cpu_quota": cpu_quota,
        "shm": options.shm_size,
        "cgroup_parent": cgroup_parent,
    }
    spec = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    labels = {
        LABEL_MANAGED: "1",
        LABEL_RUN_ID: run_id,
        LABEL_VENDOR: vendor,
        LABEL_GROUP: group,
        LABEL_AGENT_HOST: agent.host,
        LABEL_AGENT_PID: str(agent.pid),
        LABEL_AGENT_START: agent.start,
        LABEL_KEEP: "1" if options.keep_containers else "0",
        LABEL_SPEC: spec,
    }
    if options.keep_containers:
        # Kept containers outlive the run and are reused by any later run with
        # the same shape, so their name says the shape, not the run.
        name = f"kaitian-{_sanitize(group)}-{spec[:12]}"
    else:
        name = f"kaitian-{_sanitize(run_id)[:40]}-{_sanitize(group)}-{agent.pid}"
    return ContainerPlan(
        name=name,
        image=image,
        group=group,
        vendor=vendor,
        labels=labels,
        mounts=ordered_mounts,
        devices=devices,
        gpu_ids=gpu_ids,
        cpuset=cpuset,
        cpu_quota=cpu_quota,
        shm_size=options.shm_size,
        cpu_shares=1024 * max(1, len(workers)),
        cgroup_parent=cgroup_parent,
        index_map=index_map,
        device_env=dict(seen.env),
        spec=spec,
    )


def worker_env(
    env: Mapping[str, str],
    *,
    vendor: str,
    index_map: Mapping[int, int],
    mounted: Sequence[str],
) -> Dict[str, str]:
    """The worker's environment as it must look inside the container.

    Host-software variables (``PATH``, ``LD_LIBRARY_PATH``, ``PYTHONHOME`` …) are
    left to the image; the vendor's visibility variable is renumbered to the
    container's device numbering; ``TMPDIR`` is kept only if it is mounted.
    Everything torchrun and kaitianrun set passes through unchanged.
    """
    out = {k: v for k, v in env.items() if k not in _HOST_ONLY_ENV}
    tmp = out.get("TMPDIR")
    if tmp and not any(tmp == m or tmp.startswith(m.rstrip("/") + "/") for m in mounted):
        del out["TMPDIR"]
    visible = VENDORS[vendor].visible_env if vendor in VENDORS else None
    if visible and visible in out and index_map:
        renumbered = []
        for item in out[visible].split(","):
            item = item.strip()
            if item.isdigit() and int(item) in index_map:
                renumbered.append(str(index_map[int(item)]))
            elif item:
                renumbered.append(item)
        out[visible] = ",".join(renumbered)
    return out


def plan_exec(
    *,
    worker: "object",
    container: ContainerPlan,
    entrypoint: str,
    args: Sequence[object],
    env: Mapping[str, str],
    cwd: str,
    pid_file: str,
    user: str,
    host_python: Sequence[str] = (),
    image_python: str = "python3",
) -> ExecPlan:
    """Plans the ``docker exec`` of one worker.

    Args:
        worker: the worker's ``WorkerLaunch``.
        container: its group's container plan.
        entrypoint: the agent's entrypoint (the host's python, or a binary).
        args: the worker's arguments.
        env: the worker's full environment as the agent built it.
        cwd: working directory (mounted at the same path).
        pid_file: host path (in the mounted run dir) for the in-container pid.
        user: ``uid:gid`` to run as.
        host_python: paths of the host's interpreter; an entrypoint equal to one
            of them is replaced by the image's python.
        image_python: the image's python (``org.kaitian.python`` label or ``python3``).

    Returns:
        The exec plan.
    """
    program = image_python if entrypoint in set(host_python) else entrypoint
    cpus = format_cpulist(worker.cpus) if worker.cpus else ""
    cmd = ("sh", "-c", WRAPPER_SCRIPT, pid_file, cpus, program, *[str(a) for a in args])
    mounted = [m.target for m in container.mounts]
    return ExecPlan(
        local_rank=worker.local_rank,
        group=container.group,
        cmd=cmd,
        env={
            **worker_env(env, vendor=container.vendor, index_map=container.index_map, mounted=mounted),
            **container.device_env,
        },
        workdir=cwd,
        user=user,
        pid_file=pid_file,
    )


def stop_command(pgids: Iterable[int], sig_name: str) -> Tuple[str, ...]:
    """The in-container command that signals whole worker process groups.

    ``kill`` may fail for groups that are already gone; the others still get
    the signal, so the exit status is ignored (``|| true`` per group).
    """
    sig = sig_name[3:] if sig_name.startswith("SIG") else sig_name
    parts = [f"kill -s {shlex.quote(sig)} -- -{int(p)} 2>/dev/null || true" for p in pgids]
    return ("sh", "-c", "; ".join(parts) or "true")


def exit_code_from_docker(code: Optional[int]) -> int:
    """torchrun's exit code (``-N`` for a signal) from the Engine's (``128 + N``).

    The Engine reports a worker killed by signal N as ``128 + N``, which is also
    what a shell reports, so the mapping is the one users expect from torchrun.
    """
    if code is None:
        return -9
    if 128 < code < 128 + 65:
        return -(code - 128)
    return code
