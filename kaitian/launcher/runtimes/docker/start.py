"""The docker start as a plan: which containers, which ``docker exec`` per worker, decided with no daemon.

As torchx's docker scheduler, the docker runtime is split in two: this module
turns one start's workers (their complete environments from
:mod:`kaitian.launcher.environment`), what the runtime read from the host and
the engine (:class:`DockerHost`) and the options into a :class:`DockerStart`,
plain frozen records that print (``kaitianrun --runtime docker --dry-run``);
``runtime`` carries it out. A container's settings are its spec's fields, and
its digest is computed from them (so a kept container is reused only when every
setting matches).

Every container is hardened the same way: all capabilities dropped (root,
only when asked for with ``--container-user root``, keeps ``DAC_OVERRIDE`` to
write the agent's owner-only directories), ``no-new-privileges``, a read-only
root file system with a private ``/tmp``, the agent's own identity (never more
than the agent has), and bind mounts of exactly the directories the run needs.
Host network and IPC stay: the rendezvous and the shared-memory bridge between
groups need them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from kaitian.devices.device import ContainerDevices
from kaitian.devices.inventory import format_cpulist
from kaitian.devices.vendors import VENDORS, vendor as vendor_entry
from kaitian.errors import DockerOptionError
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.runtimes.docker.options import ROOT_USER, DockerOptions, Mount
from kaitian.settings import Settings

__all__ = [
    "ContainerSpec", "ExecSpec", "DockerHost", "DockerStart", "ImageInfo", "LogFiles", "docker_start",
    "container_spec", "exec_spec", "container_env", "choose_user", "image_for", "group_devices", "groups_of",
    "as_binary", "inside", "outermost", "AgentIdentity", "MAIN_TIED", "MAIN_KEPT", "WRAPPER_SCRIPT",
]

# Labels are the only state kept outside the agent: a container's run, group, shape (spec) and owning
# agent, so a later agent tells a live owner from a dead one. Image labels (`kaitian images build`):
# host paths the image needs mounted at the same path, and its python.
LABEL_MANAGED = "org.kaitian.managed"
LABEL_RUN_ID = "org.kaitian.run-id"
LABEL_VENDOR = "org.kaitian.vendor"
LABEL_GROUP = "org.kaitian.group"
LABEL_AGENT_HOST = "org.kaitian.agent-host"
LABEL_AGENT_PID = "org.kaitian.agent-pid"
LABEL_AGENT_START = "org.kaitian.agent-start"
LABEL_KEEP = "org.kaitian.keep"
LABEL_SPEC = "org.kaitian.spec"
LABEL_HOST_MOUNTS = "org.kaitian.host-mounts"
LABEL_PYTHON = "org.kaitian.python"

# A run's container lives while the agent's stdin attach is open: when the agent dies, however, the
# engine closes it, the container stops, its pid namespace dies and the engine removes it.
MAIN_TIED = ("sh", "-c", "while read -r _; do :; done")
MAIN_KEPT = ("sleep", "infinity")  # --keep-containers: outlives its agent
# Every worker's exec: records its in-container pid (= its process group: an exec starts a session;
# elsewhere setsid makes one without forking), writes straight to its log files when it has them (the
# exec stream can drop a dying process's last lines), pins its cores, then becomes the worker (so the
# exec's exit code is the worker's). POSIX sh only, so any image works.
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

# Capabilities root keeps when asked for (--container-user root): writing into
# the agent's owner-only run and log directories. Other workers keep none.
ROOT_CAPABILITIES = ("DAC_OVERRIDE",)
# The private, writable /tmp of the read-only container (HOME points there).
TMPFS = {"/tmp": "rw,nosuid,nodev,mode=1777"}
CONTAINER_HOME = "/tmp"
# Host variables that describe the host's software, not the job: the image has its own.
HOST_ONLY_ENV = frozenset({
    "PATH", "HOME", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "LD_LIBRARY_PATH", "LD_PRELOAD",
    "PYTHONHOME", "PYTHONEXECUTABLE", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_EXE",
    "CONDA_PYTHON_EXE", "CONDA_SHLVL", "PYENV_VERSION", "PYENV_DIR", "PYENV_ROOT", "PYENV_HOOK_PATH", "PYENV_SHELL",
})
CPU_PERIOD_US = 100_000
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")
# `--run-path`: torchrun runs the script with runpy in the worker process; in a
# container the same happens in the image's python.
_RUN_PATH_CODE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


@dataclass(frozen=True)
class AgentIdentity:
    """The agent owning a container: host, pid and process start time (a recycled pid is not it)."""

    host: str
    pid: int
    start: str


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or below it (absolute, normalised paths)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def outermost(paths: Iterable[str]) -> List[str]:
    """The paths not inside another one of them, shortest first (one inside another is visible through it)."""
    kept: List[str] = []
    for path in sorted(set(paths), key=len):
        if not any(inside(path, k) for k in kept):
            kept.append(path)
    return kept


@dataclass(frozen=True)
class ContainerSpec:
    """One container for one kaitian group on this node.

    Its settings are its fields, and its digest is computed from all of them
    but ``IDENTITY``: what names the container's owner rather than shapes it.

    Attributes:
        group: kaitian group (``KAITIAN_GROUP``) whose workers run inside.
        run_id: the rendezvous run id.
        agent: the owning agent.
        cpu_shares: CPU weight: 1024 per worker started in it, so under
            contention the group's workers weigh what as many local processes
            would. Not a reason to recreate a container: a worker started
            again alone (``--on-failure continue``) joins its group's
            container, whose other workers keep running.
        image: image reference.
        vendor: the group's device type.
        mounts: bind mounts, host paths at identical container paths.
        devices: the group's devices as the container holds them.
        user: ``uid:gid`` of the container's processes (workers included).
        capabilities: the capabilities the container keeps (all others are dropped).
        tied: the container lives only as long as its agent (its main process
            reads the agent's stdin attach, and the engine removes it when it
            stops); ``--keep-containers`` containers are not tied.
        cpuset: ``cpuset-cpus`` of the container (``None``: all cores).
        cpu_quota: CPU time the container may use, in cores (``None``: no limit).
        cgroup_parent: cgroup to create the container's cgroup in (``None``: the
            engine's default, one cgroup for every container that weighs as much
            as a single process; the runtime passes the agent's own where the
            engine allows it, so containerised workers compete as local ones do).
        shm_size: ``--shm-size``.
    """

    group: str
    run_id: str
    agent: AgentIdentity
    cpu_shares: int
    image: str
    vendor: str
    mounts: Tuple[Mount, ...]
    devices: ContainerDevices = field(default_factory=ContainerDevices)
    user: str = ROOT_USER
    capabilities: Tuple[str, ...] = ()
    tied: bool = True
    cpuset: Optional[str] = None
    cpu_quota: Optional[float] = None
    cgroup_parent: Optional[str] = None
    shm_size: str = "2g"

    IDENTITY = ("group", "run_id", "agent", "cpu_shares")

    @property
    def settings(self) -> Dict[str, object]:
        """Every field that shapes the container (all but ``IDENTITY``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.IDENTITY}

    @property
    def digest(self) -> str:
        """Hash of :attr:`settings`: a container is reused only when it matches."""
        shape = json.dumps(_plain(self.settings), sort_keys=True)
        return hashlib.sha256(shape.encode()).hexdigest()[:16]

    @property
    def labels(self) -> Dict[str, str]:
        """Run id, vendor, group, owner and digest: the only state kept outside the agent."""
        return {
            LABEL_MANAGED: "1", LABEL_RUN_ID: self.run_id, LABEL_VENDOR: self.vendor, LABEL_GROUP: self.group,
            LABEL_AGENT_HOST: self.agent.host, LABEL_AGENT_PID: str(self.agent.pid),
            LABEL_AGENT_START: self.agent.start, LABEL_KEEP: "0" if self.tied else "1", LABEL_SPEC: self.digest,
        }

    @property
    def name(self) -> str:
        """A run's container names its run, group and agent; a kept one outlives
        the run and serves any later run of the same shape, so it names the shape."""
        if self.tied:
            return f"kaitian-{_sanitize(self.run_id)[:40]}-{_sanitize(self.group)}-{self.agent.pid}"
        return f"kaitian-{_sanitize(self.group)}-{self.digest[:12]}"

    def create_kwargs(self) -> Dict[str, object]:
        """Keyword arguments for ``client.containers.create`` (docker SDK).

        A tied container is created like ``docker run -i --rm``: stdin open
        and closed when its one attached client (the agent) goes away.
        """
        kwargs: Dict[str, object] = {
            "image": self.image, "command": list(MAIN_TIED if self.tied else MAIN_KEPT), "name": self.name,
            "labels": self.labels, "detach": not self.tied, "stdin_open": self.tied, "auto_remove": self.tied,
            "init": True,  # reaps orphans left by exec'd workers
            "user": self.user, "network_mode": "host", "ipc_mode": "host", "shm_size": self.shm_size,
            "privileged": False, "cap_drop": ["ALL"], "cap_add": list(self.capabilities),
            "security_opt": ["no-new-privileges"], "read_only": True, "tmpfs": dict(TMPFS),
            "mounts": [m.to_docker() for m in self.mounts], "devices": list(self.devices.device_nodes),
            "cpu_shares": self.cpu_shares,
        }
        if self.devices.device_requests:
            kwargs["device_requests"] = [dict(r) for r in self.devices.device_requests]
        if self.cpuset:
            kwargs["cpuset_cpus"] = self.cpuset
        if self.cgroup_parent:
            kwargs["cgroup_parent"] = self.cgroup_parent
        if self.cpu_quota is not None:
            kwargs["cpu_period"] = CPU_PERIOD_US
            kwargs["cpu_quota"] = max(1000, int(round(self.cpu_quota * CPU_PERIOD_US)))
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


@dataclass(frozen=True)
class ImageInfo:
    """What an image declares through its labels.

    Attributes:
        mounts: host paths it needs bind-mounted (``org.kaitian.host-mounts``).
        python: its Python interpreter (``org.kaitian.python``, default ``python3``).
    """

    mounts: Tuple[Mount, ...] = ()
    python: str = "python3"


@dataclass(frozen=True)
class DockerHost:
    """What the docker start depends on outside the start itself: read once by the runtime.

    Attributes:
        run_id: the rendezvous run id.
        run_dir: this node's run directory.
        cwd: the user's working directory.
        log_dir: torchrun's ``--log-dir``, or ``None``.
        agent: the owning agent.
        user: ``uid:gid`` of the workers (:func:`choose_user`).
        hands_over: a root agent gives the workers' directories to their (other) user.
        images: image reference -> what it declares.
        cgroup_parent: the agent's own cgroup where the engine allows it (``None``: the default).
        cpu_quotas: group -> its CPU time in cores.
        host_python: the host interpreter's paths (an entrypoint equal to one becomes the image's python).
        device_nodes: device nodes present on this host (``None``: look in ``/dev``).
        agent_env: the agent's environment, which workers inherit beneath their own (as
            torch's local subprocesses do), the host's software variables left out.
    """

    run_id: str
    run_dir: str
    cwd: str
    log_dir: Optional[str]
    agent: AgentIdentity
    user: str
    hands_over: bool = False
    images: Mapping[str, ImageInfo] = field(default_factory=dict)
    cgroup_parent: Optional[str] = None
    cpu_quotas: Mapping[str, float] = field(default_factory=dict)
    host_python: Tuple[str, ...] = ()
    device_nodes: Optional[Tuple[str, ...]] = None
    agent_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def pid_dir(self) -> str:
        """Where the workers' wrappers write their in-container pids."""
        return os.path.join(self.run_dir, "docker-pids")


@dataclass(frozen=True)
class DockerStart:
    """One start under the docker runtime: what to create, what to exec, which directories to hand over.

    Attributes:
        containers: one per group of the workers started, reused when one with
            the same labels and digest is there.
        execs: the start's key -> the worker's exec (into its group's container).
        hand_over: directories a root agent gives to the workers' user.
        make_dirs: directories the plan mounts that must exist first (``--monitor``).
    """

    containers: Tuple[ContainerSpec, ...]
    execs: Mapping[int, ExecSpec]
    hand_over: Tuple[str, ...] = ()
    make_dirs: Tuple[str, ...] = ()

    def container(self, group: str) -> ContainerSpec:
        return next(c for c in self.containers if c.group == group)

    def to_text(self, inherited: Mapping[str, str] = {}) -> str:  # noqa: B006 (read only)
        """The plan as YAML (what ``--dry-run`` prints).

        Args:
            inherited: the agent's own environment: a worker's variable with the
                same value is left out (it is only inherited).
        """
        lines = ["containers:"]
        for c in self.containers:
            lines.append(f"- name: {c.name}")
            lines += [f"  {k}: {json.dumps(_plain(v))}" for k, v in {
                **c.settings, "cpu_shares": c.cpu_shares, "digest": c.digest, "labels": c.labels}.items()]
        lines.append("execs:")
        for key in sorted(self.execs):
            ex = self.execs[key]
            lines.append(f"- local_rank: {ex.local_rank}")
            lines += [f"  {k}: {json.dumps(v)}" for k, v in (
                ("container", self.container(ex.group).name), ("user", ex.user), ("workdir", ex.workdir),
                ("argv", list(ex.cmd[7:])), ("cpus", ex.cmd[4]), ("pid_file", ex.pid_file), ("stdout", ex.stdout),
                ("stderr", ex.stderr))]
            lines.append("  env:  # besides the agent's own")
            lines += [f"    {k}: {json.dumps(ex.env[k])}" for k in sorted(ex.env) if inherited.get(k) != ex.env[k]]
        if self.hand_over:
            lines.append(f"hand_over: {json.dumps(list(self.hand_over))}")
        return "\n".join(lines)


def _plain(value: object) -> object:
    """JSON-ready: dataclasses as dicts, tuples as lists, mapping keys as strings."""
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _sanitize(text: str) -> str:
    return _NAME_UNSAFE.sub("-", text).strip("-.") or "x"


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
        raise DockerOptionError(f"no image for device type {vendor!r}: pass --image {vendor}=IMAGE[:TAG]") from None


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


def groups_of(workers: Mapping[int, LocalWorker]) -> Dict[str, List[LocalWorker]]:
    """The workers by group, in key order."""
    groups: Dict[str, List[LocalWorker]] = {}
    for key in sorted(workers):
        groups.setdefault(workers[key].device.group, []).append(workers[key])
    return groups


def as_binary(entrypoint: object, args: Mapping[int, Tuple]) -> Tuple[str, Dict[int, Tuple]]:
    """A program and its arguments: the entrypoint itself, or for torchrun's
    ``--run-path`` function its ``python -c`` equivalent.

    Raises:
        DockerOptionError: any other Python function (cannot cross into a container).
    """
    if isinstance(entrypoint, str):
        return entrypoint, dict(args)
    if getattr(entrypoint, "__name__", "") == "run_script_path":
        return sys.executable, {r: ("-u", "-c", _RUN_PATH_CODE, *a) for r, a in args.items()}
    raise DockerOptionError(
        "the docker runtime starts programs (python scripts, --no-python binaries), not Python functions"
    )


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
    """The container of one group (see :class:`ContainerSpec` for each setting).

    Args:
        workers: the group's workers started together (one device type).
        run_dir: the directory holding the node's run state (mounted at the same path).
        log_dirs: host directories where workers write files (error files).
        image_mounts: host paths the image asks for (``org.kaitian.host-mounts``).
        device_nodes: device nodes present on this host (default: look in ``/dev``).

    Raises:
        DockerOptionError: the group mixes device types, or a directory to mount is ``/``.
        DeviceSelectionError: a device the container needs is missing on this host.
    """
    vendor, devices = group_devices(group, workers, device_nodes)
    all_cpus = [c for w in workers for c in w.cpus]
    mounts: Dict[str, Mount] = {m.target: m for m in image_mounts}
    # Exactly the run's own directories, at identical paths (never a parent:
    # --log-dir /tmp/x mounts /tmp/x, not /tmp). One inside another is
    # already visible, and dropping it keeps the shape (and so reuse) stable.
    own = {os.path.abspath(p) for p in (cwd, run_dir, *log_dirs) if p and p != os.devnull}
    if "/" in own:
        raise DockerOptionError(
            "the docker runtime mounts the working and log directories into the containers; "
            "run kaitianrun from a project directory (and give --log-dir a directory), not /"
        )
    for path in outermost(own):
        mounts[path] = Mount(path, path, False)
    for m in options.volumes:
        mounts[m.target] = m
    return ContainerSpec(
        group=group, run_id=run_id, agent=agent, cpu_shares=1024 * max(1, len(workers)),
        image=image, vendor=vendor, mounts=tuple(mounts[t] for t in sorted(mounts)), devices=devices, user=user,
        # Root workers for a root agent gain nothing; asked for by name, root may
        # write the (non-root) agent's owner-only directories.
        capabilities=ROOT_CAPABILITIES if options.user == ROOT_USER else (),
        tied=not options.keep_containers,
        # Pinned only when every worker is pinned; otherwise left free.
        cpuset=format_cpulist(all_cpus) if all_cpus and all(w.cpus for w in workers) else None,
        cpu_quota=cpu_quota, cgroup_parent=cgroup_parent, shm_size=options.shm_size,
    )


def container_env(env: Mapping[str, str], mounted: Sequence[str]) -> Dict[str, str]:
    """A worker's environment as it must look inside its container.

    Host-software variables (``PATH``, ``LD_LIBRARY_PATH``, ``PYTHONHOME`` …)
    are left to the image; ``HOME`` is the container's tmpfs; ``TMPDIR`` is
    kept only if it is mounted. Everything else passes through unchanged.
    """
    out = {k: v for k, v in env.items() if k not in HOST_ONLY_ENV}
    out["HOME"] = CONTAINER_HOME
    tmp = out.get("TMPDIR")
    if tmp and not any(inside(tmp, m) for m in mounted):
        del out["TMPDIR"]
    return out


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
        entrypoint: the agent's entrypoint (the host's python, or a binary).
        env: the worker's complete environment on the host.
        pid_file: host path (in the mounted run dir) for the in-container pid.
        stdout: the worker's stdout log file (``""``: none); written by the
            worker itself when a mount shows it, else streamed.
        stderr: the same for stderr.
        host_python: paths of the host's interpreter; an entrypoint equal to one
            of them is replaced by the image's python (``image_python``).
    """
    program = image_python if entrypoint in set(host_python) else entrypoint
    cpus = format_cpulist(worker.cpus) if worker.cpus else ""
    mounted = [m.target for m in container.mounts]
    stdout, stderr = (path if path and any(inside(path, m) for m in mounted) else "" for path in (stdout, stderr))
    cmd = ("sh", "-c", WRAPPER_SCRIPT, pid_file, cpus, stdout, stderr, program, *[str(a) for a in args])
    return ExecSpec(local_rank=worker.local_rank, group=container.group, cmd=cmd, env=container_env(env, mounted),
                    workdir=cwd, user=container.user, pid_file=pid_file, stdout=stdout, stderr=stderr)


def _files(paths: Mapping[int, str]) -> List[str]:
    return [p for p in paths.values() if p and p != os.devnull]


def docker_start(
    workers: Mapping[int, LocalWorker],
    entrypoint: object,
    args: Mapping[int, Tuple],
    envs: Mapping[int, Mapping[str, str]],
    logs: "LogFiles",
    host: DockerHost,
    options: DockerOptions,
) -> DockerStart:
    """The plan of one start: a container per group of ``workers``, an exec per worker.

    Args:
        workers: the start's key -> the worker.
        entrypoint: the workers' program (or torchrun's ``--run-path`` function).
        args: their arguments by key.
        envs: their complete environments by key (``host.agent_env`` goes beneath).
        logs: where torch decided their logs and error files go.
        host: what the runtime read from the host and the engine.
        options: the docker options.

    Raises:
        DockerOptionError: an option or entrypoint that cannot be used.
        DeviceSelectionError: a device a container needs is missing on this host.
    """
    program, args = as_binary(entrypoint, args)
    cwd = os.path.abspath(host.cwd)
    run_dir = os.path.abspath(host.run_dir)
    errors = [os.path.dirname(os.path.abspath(p)) for p in _files(logs.error_files)]
    # Host directories workers write into: exactly those, never a parent.
    log_dirs = {os.path.abspath(logs.root)} if logs.root and logs.root != os.devnull else set()
    log_dirs |= {d for d in errors if not any(inside(d, m) for m in log_dirs)}
    if host.log_dir:
        log_dirs.add(os.path.abspath(host.log_dir))
    given = [Settings.from_env(env) for env in envs.values()]
    monitor_dirs = {os.path.abspath(os.path.join(cwd, s.monitor_dir)) for s in given if s.monitor_dir}
    log_dirs |= monitor_dirs  # kaitianrun --monitor: ranks write their samples there

    # Kept containers mount the directory of all run directories: later runs' are new siblings there.
    state_dir = os.path.dirname(run_dir) if options.keep_containers else run_dir
    containers: Dict[str, ContainerSpec] = {}
    for group, members in groups_of(workers).items():
        ref = image_for(group, members[0].device.type, options.images)
        containers[group] = container_spec(
            group=group, workers=members, image=ref, cpu_quota=host.cpu_quotas.get(group), run_id=host.run_id,
            run_dir=state_dir, cwd=cwd, log_dirs=sorted(log_dirs), options=options, agent=host.agent,
            user=host.user, image_mounts=host.images.get(ref, ImageInfo()).mounts, device_nodes=host.device_nodes,
            cgroup_parent=host.cgroup_parent,
        )
    execs = {
        key: exec_spec(
            worker=w, container=containers[w.device.group], entrypoint=program, args=args[key],
            env={**host.agent_env, **envs[key]}, cwd=cwd,
            pid_file=os.path.join(host.pid_dir, f"{w.local_rank}.pid"),  # a worker restarted alone is key 0
            stdout=logs.stdouts.get(key, ""), stderr=logs.stderrs.get(key, ""), host_python=host.host_python,
            image_python=host.images.get(containers[w.device.group].image, ImageInfo()).python,
        )
        for key, w in workers.items()
    }
    hand_over: Tuple[str, ...] = ()
    if host.hands_over:
        # A non-root worker writes in: the run directory, this start's and the pid
        # directory, the monitor directory, and the directories torch made for
        # error files below a log directory (never the user's --log-dir itself).
        writable = {run_dir, host.pid_dir, *monitor_dirs}
        writable |= {os.path.abspath(s.run_dir) for s in given if s.run_dir}
        roots = [run_dir, *log_dirs]
        for d in errors:
            while any(d != r and inside(d, r) for r in roots):
                writable.add(d)
                d = os.path.dirname(d)
        hand_over = tuple(sorted(writable))
    return DockerStart(tuple(containers.values()), execs, hand_over, tuple(sorted(monitor_dirs)))


@dataclass(frozen=True)
class LogFiles:
    """Where torch put one start's logs: by key, ``""`` for none.

    Attributes:
        root: the logs specs' root directory (``None``: custom specs without one).
        stdouts: each worker's stdout file.
        stderrs: each worker's stderr file.
        error_files: each worker's error file.
    """

    root: Optional[str] = None
    stdouts: Mapping[int, str] = field(default_factory=dict)
    stderrs: Mapping[int, str] = field(default_factory=dict)
    error_files: Mapping[int, str] = field(default_factory=dict)
