"""What the docker runtime will do, decided without touching a daemon.

The docker runtime is split in two (as torchx's docker scheduler is): this
module turns a run's workers and options into specs, plain dataclasses describing
one container per kaitian group and one ``docker exec`` per worker; ``runtime``
carries them out with the docker SDK. Everything here is pure, so it is unit
tested without an engine.

Every container is hardened the same way: all capabilities dropped (root,
only when asked for with ``--container-user root``, keeps ``DAC_OVERRIDE`` to
write the agent's owner-only directories), ``no-new-privileges``, a read-only
root file system with a private ``/tmp``, the agent's own identity (never more
than the agent has), and bind mounts of exactly the directories the run needs. Host network and IPC stay: the rendezvous and the
shared-memory bridge between groups need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from kaitian.devices.inventory import format_cpulist
from kaitian.devices.vendors import VENDORS, vendor as vendor_entry
from kaitian.errors import DockerOptionError
from kaitian.devices.device import ContainerDevices
from kaitian.launcher.plan import LocalWorker
from kaitian.launcher.runtimes.docker.environment import worker_env
from kaitian.launcher.runtimes.docker.labels import (
    LABEL_AGENT_HOST,
    LABEL_AGENT_PID,
    LABEL_AGENT_START,
    LABEL_GROUP,
    LABEL_KEEP,
    LABEL_MANAGED,
    LABEL_RUN_ID,
    LABEL_SPEC,
    LABEL_VENDOR,
    AgentIdentity,
)
from kaitian.launcher.runtimes.docker.options import ROOT_USER, DockerOptions, Mount
from kaitian.launcher.runtimes.docker.paths import inside, outermost
from kaitian.launcher.runtimes.docker.shell import MAIN_KEPT, MAIN_TIED, WRAPPER_SCRIPT

__all__ = [
    "ContainerSpec",
    "ExecSpec",
    "choose_user",
    "image_for",
    "container_spec",
    "exec_spec",
]

# Capabilities root keeps when asked for (--container-user root): writing into
# the agent's owner-only run and log directories. Other workers keep none.
ROOT_CAPABILITIES = ("DAC_OVERRIDE",)
# The private, writable /tmp of the read-only container (HOME points there).
TMPFS = {"/tmp": "rw,nosuid,nodev,mode=1777"}

_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")


@dataclass(frozen=True)
class ContainerSpec:
    """One container for one kaitian group on this node.

    Attributes:
        name: container name.
        image: image reference.
        group: kaitian group (``KAITIAN_GROUP``) whose workers run inside.
        vendor: the group's device type.
        labels: container labels (run id, vendor, group, owner, spec hash).
        mounts: bind mounts, host paths at identical container paths.
        devices: the group's devices as the container holds them.
        user: ``uid:gid`` of the container's processes (workers included).
        capabilities: the capabilities the container keeps (all others are dropped).
        tied: the container lives only as long as its agent (its main process
            reads the agent's stdin attach, and the engine removes it when it
            stops); ``--keep-containers`` containers are not tied.
        cpuset: ``cpuset-cpus`` of the container (``None``: all cores).
        cpu_quota: CPU time the container may use, in cores (``None``: no limit).
        cpu_shares: CPU weight: 1024 per worker, so under contention the
            group's workers weigh what as many local processes would.
        cgroup_parent: cgroup to create the container's cgroup in (``None``:
            the engine's default); see ``container_spec``.
        shm_size: ``--shm-size``.
        digest: hash of everything above that shapes the container, so a
            container is reused only when it matches.
    """

    name: str
    image: str
    group: str
    vendor: str
    labels: Mapping[str, str]
    mounts: Tuple[Mount, ...]
    devices: ContainerDevices = field(default_factory=ContainerDevices)
    user: str = ROOT_USER
    capabilities: Tuple[str, ...] = ()
    tied: bool = True
    cpuset: Optional[str] = None
    cpu_quota: Optional[float] = None
    cpu_shares: int = 1024
    cgroup_parent: Optional[str] = None
    shm_size: str = "2g"
    digest: str = ""

    CPU_PERIOD_US = 100_000

    def create_kwargs(self) -> Dict[str, object]:
        """Keyword arguments for ``client.containers.create`` (docker SDK).

        A tied container is created like ``docker run -i --rm``: stdin open
        and closed when its one attached client (the agent) goes away.
        """
        kwargs: Dict[str, object] = {
            "image": self.image,
            "command": list(MAIN_TIED if self.tied else MAIN_KEPT),
            "name": self.name,
            "labels": dict(self.labels),
            "detach": not self.tied,
            "stdin_open": self.tied,
            "auto_remove": self.tied,
            "init": True,  # reaps orphans left by exec'd workers
            "user": self.user,
            "network_mode": "host",
            "ipc_mode": "host",
            "shm_size": self.shm_size,
            "privileged": False,
            "cap_drop": ["ALL"],
            "cap_add": list(self.capabilities),
            "security_opt": ["no-new-privileges"],
            "read_only": True,
            "tmpfs": dict(TMPFS),
            "mounts": [m.to_docker() for m in self.mounts],
            "devices": list(self.devices.device_nodes),
        }
        if self.devices.device_requests:
            kwargs["device_requests"] = [dict(r) for r in self.devices.device_requests]
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
        """One line for logs: name, image, devices, cpuset, user."""
        parts = [f"{self.name} ({self.image})", f"user {self.user}"]
        for request in self.devices.device_requests:
            parts.append(f"gpus {','.join(map(str, request.get('device_ids') or []))}")
        if self.devices.device_nodes:
            parts.append(f"{len(self.devices.device_nodes)} device nodes")
        if self.cpuset:
            parts.append(f"cpuset {self.cpuset}")
        if self.cpu_quota is not None:
            parts.append(f"{self.cpu_quota:g} cores of CPU time")
        return ", ".join(parts)


@dataclass(frozen=True)
class ExecSpec:
    """One worker as a ``docker exec`` into its group's container.

    Attributes:
        local_rank: the worker's local rank.
        group: container group it runs in.
        cmd: the exec's argv (wrapper script, then the worker's argv).
        env: the worker's environment inside the container.
        workdir: working directory (the user's cwd, mounted at the same path).
        user: ``uid:gid`` the worker runs as (the container's user).
        pid_file: host path where the wrapper writes the in-container pid.
        stdout: host path (in a mount) the worker itself writes its stdout to;
            ``""``: it comes through the exec's stream.
        stderr: the same for stderr.
    """

    local_rank: int
    group: str
    cmd: Tuple[str, ...]
    env: Mapping[str, str]
    workdir: str
    user: str
    pid_file: str
    stdout: str = ""
    stderr: str = ""

    def env_list(self) -> List[str]:
        """``KEY=value`` strings, as the Engine API takes them."""
        return [f"{k}={v}" for k, v in self.env.items()]


def choose_user(requested: Optional[str], agent_uid: int, agent_gid: int, cwd_owner: Tuple[int, int]) -> str:
    """The ``uid:gid`` workers run as.

    ``--container-user`` if given; else, for a root agent in a user's project
    (``sudo kaitianrun``), the owner of the working directory; else the agent's
    own identity, so workers write where local workers would (a root agent in a
    root-owned directory: root, with every capability dropped).
    """
    if requested:
        return requested
    if agent_uid == 0 and cwd_owner[0] != 0:
        return f"{cwd_owner[0]}:{cwd_owner[1]}"
    return f"{agent_uid}:{agent_gid}"


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


def group_devices(group: str, workers: Sequence[LocalWorker],
                  device_nodes: Optional[Iterable[str]] = None) -> Tuple[str, ContainerDevices]:
    """The vendor of a group's container and the devices it holds (what its workers see).

    Raises:
        DockerOptionError: the group mixes device types.
        DeviceSelectionError: a device the container needs is missing on this host.
    """
    vendors = {w.device.type for w in workers}
    if len(vendors) != 1:
        raise DockerOptionError(f"group {group!r} mixes device types {sorted(vendors)}; one vendor per group")
    vendor = vendors.pop()
    return vendor, vendor_entry(vendor).container_devices([w.device for w in workers], device_nodes)


def _sanitize(text: str) -> str:
    return _NAME_UNSAFE.sub("-", text).strip("-.") or "x"


def container_spec(
    *,
    group: str,
    workers: Sequence[LocalWorker],
    image: str,
    cpu_quota: Optional[float],
    run_id: str,
    run_dir: str,
    cwd: str,
    log_dirs: Iterable[str],
    options: DockerOptions,
    agent: AgentIdentity,
    user: str = ROOT_USER,
    image_mounts: Iterable[Mount] = (),
    device_nodes: Optional[Iterable[str]] = None,
    cgroup_parent: Optional[str] = None,
) -> ContainerSpec:
    """The container of one group.

    Args:
        group: the kaitian group.
        workers: the group's workers (same device type).
        image: image reference for the group.
        cpu_quota: the CPU time the group's workers share, in cores (``None``: no limit).
        run_id: the rendezvous run id.
        run_dir: the directory holding the node's run state (mounted at the
            same path): the run directory itself, or for kept containers the
            directory of all run directories, so later runs reuse them.
        cwd: the user's working directory (mounted at the same path).
        log_dirs: host directories where workers write files (error files).
        options: the checked docker options.
        agent: the owning agent.
        user: ``uid:gid`` of the workers (``choose_user``).
        image_mounts: host paths the image asks for (``org.kaitian.host-mounts``).
        device_nodes: device nodes present on this host (default: look in ``/dev``).
        cgroup_parent: where the container's cgroup goes. By default the engine
            nests every container under one cgroup (``/docker``) that weighs as
            much as a single process, so on a busy host containerised workers
            get a fraction of the CPU local workers get; the runtime passes the
            agent's own cgroup where the engine allows it, so they compete as
            local workers do.

    Returns:
        The container's spec.

    Raises:
        DockerOptionError: the group mixes device types, or a directory to mount is ``/``.
        DeviceSelectionError: a device the container needs is missing on this host.
    """
    vendor, devices = group_devices(group, workers, device_nodes)

    all_cpus = [c for w in workers for c in w.cpus]
    # Pin the container only when every worker is pinned; otherwise leave it free.
    cpuset = format_cpulist(all_cpus) if all_cpus and all(w.cpus for w in workers) else None

    mounts: Dict[str, Mount] = {}
    for m in image_mounts:
        mounts[m.target] = m
    # Exactly the run's own directories, at identical paths (never a parent:
    # --log-dir /tmp/x mounts /tmp/x, not /tmp). One inside another is
    # already visible, and dropping it keeps the shape (and so reuse) stable.
    own = sorted({os.path.abspath(p) for p in (cwd, run_dir, *log_dirs) if p and p != os.devnull}, key=len)
    if "/" in own:
        raise DockerOptionError(
            "the docker runtime mounts the working and log directories into the containers; "
            "run kaitianrun from a project directory (and give --log-dir a directory), not /"
        )
    for path in outermost(own):
        mounts[path] = Mount(path, path, False)
    for m in options.volumes:
        mounts[m.target] = m
    ordered_mounts = tuple(mounts[t] for t in sorted(mounts))
    tied = not options.keep_containers
    # Root workers for a root agent gain nothing; asked for by name, root may
    # write the (non-root) agent's owner-only directories.
    capabilities = ROOT_CAPABILITIES if options.user == ROOT_USER else ()

    shape = {
        "image": image,
        "vendor": vendor,
        "mounts": [m.to_docker() for m in ordered_mounts],
        "devices": list(devices.device_nodes),
        "requests": [dict(r) for r in devices.device_requests],
        "user": user,
        "capabilities": list(capabilities),
        "tied": tied,
        "cpuset": cpuset,
        "cpu_quota": cpu_quota,
        "shm": options.shm_size,
        "cgroup_parent": cgroup_parent,
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    labels = {
        LABEL_MANAGED: "1",
        LABEL_RUN_ID: run_id,
        LABEL_VENDOR: vendor,
        LABEL_GROUP: group,
        LABEL_AGENT_HOST: agent.host,
        LABEL_AGENT_PID: str(agent.pid),
        LABEL_AGENT_START: agent.start,
        LABEL_KEEP: "0" if tied else "1",
        LABEL_SPEC: digest,
    }
    if tied:
        name = f"kaitian-{_sanitize(run_id)[:40]}-{_sanitize(group)}-{agent.pid}"
    else:
        # Kept containers outlive the run and are reused by any later run with
        # the same shape, so their name says the shape, not the run.
        name = f"kaitian-{_sanitize(group)}-{digest[:12]}"
    return ContainerSpec(
        name=name,
        image=image,
        group=group,
        vendor=vendor,
        labels=labels,
        mounts=ordered_mounts,
        devices=devices,
        user=user,
        capabilities=capabilities,
        tied=tied,
        cpuset=cpuset,
        cpu_quota=cpu_quota,
        shm_size=options.shm_size,
        cpu_shares=1024 * max(1, len(workers)),
        cgroup_parent=cgroup_parent,
        digest=digest,
    )


def exec_spec(
    *,
    worker: LocalWorker,
    container: ContainerSpec,
    entrypoint: str,
    args: Sequence[object],
    env: Mapping[str, str],
    cwd: str,
    pid_file: str,
    stdout: str = "",
    stderr: str = "",
    host_python: Sequence[str] = (),
    image_python: str = "python3",
) -> ExecSpec:
    """The ``docker exec`` of one worker.

    Args:
        worker: the worker.
        container: its group's container spec.
        entrypoint: the agent's entrypoint (the host's python, or a binary).
        args: the worker's arguments.
        env: the worker's full environment as the agent and the runtime built it.
        cwd: working directory (mounted at the same path).
        pid_file: host path (in the mounted run dir) for the in-container pid.
        stdout: the worker's stdout log file (``""``: none); written by the
            worker itself when a mount shows it, else streamed.
        stderr: the same for stderr.
        host_python: paths of the host's interpreter; an entrypoint equal to one
            of them is replaced by the image's python.
        image_python: the image's python (``org.kaitian.python`` label or ``python3``).

    Returns:
        The exec's spec.
    """
    program = image_python if entrypoint in set(host_python) else entrypoint
    cpus = format_cpulist(worker.cpus) if worker.cpus else ""
    mounted = [m.target for m in container.mounts]
    stdout, stderr = (path if path and any(inside(path, m) for m in mounted) else "" for path in (stdout, stderr))
    cmd = ("sh", "-c", WRAPPER_SCRIPT, pid_file, cpus, stdout, stderr, program, *[str(a) for a in args])
    return ExecSpec(
        local_rank=worker.local_rank,
        group=container.group,
        cmd=cmd,
        env=worker_env(env, mounted=mounted),
        workdir=cwd,
        user=container.user,
        pid_file=pid_file,
        stdout=stdout,
        stderr=stderr,
    )
