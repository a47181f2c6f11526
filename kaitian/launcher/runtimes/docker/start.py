"""The docker start as a pure plan (as torchx's ``DockerJob``): containers and execs, printable, no daemon.

Every container is hardened alike: all capabilities dropped, ``no-new-privileges``, a read-only root
with a private ``/tmp``, the agent's identity, bind mounts of exactly the run's directories. Host
network and IPC stay: the rendezvous and the shared-memory bridge between groups need them.
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

# Root, when asked for by name (--container-user root), may write the (non-root) agent's owner-only
# directories; otherwise root gains nothing and no worker keeps a capability.
ROOT_CAPABILITIES = ("DAC_OVERRIDE",)
TMPFS = {"/tmp": "rw,nosuid,nodev,mode=1777"}  # the read-only container's writable /tmp, HOME too
CONTAINER_HOME = "/tmp"
# Variables of the host's software, not of the job: the image has its own.
HOST_ONLY_ENV = frozenset({
    "PATH", "HOME", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "LD_LIBRARY_PATH", "LD_PRELOAD",
    "PYTHONHOME", "PYTHONEXECUTABLE", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_EXE",
    "CONDA_PYTHON_EXE", "CONDA_SHLVL", "PYENV_VERSION", "PYENV_DIR", "PYENV_ROOT", "PYENV_HOOK_PATH", "PYENV_SHELL",
})
CPU_PERIOD_US = 100_000
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")
# torchrun's --run-path runs the script with runpy in the worker; in a container, in the image's python.
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
    """The paths not inside another of them, shortest first (one inside another is visible through it)."""
    kept: List[str] = []
    for path in sorted(set(paths), key=len):
        if not any(inside(path, k) for k in kept):
            kept.append(path)
    return kept


@dataclass(frozen=True)
class ContainerSpec:
    """One group's container on this node: its settings are its fields, and its digest covers all but
    ``IDENTITY``, which names its owner rather than shapes it (a kept container serves later runs)."""

    group: str
    run_id: str
    agent: AgentIdentity
    # 1024 per worker: the group weighs what as many local processes would. No reason to recreate
    # it either: a worker restarted alone joins its group's running container.
    cpu_shares: int
    image: str
    vendor: str
    mounts: Tuple[Mount, ...]
    devices: ContainerDevices = field(default_factory=ContainerDevices)
    user: str = ROOT_USER
    capabilities: Tuple[str, ...] = ()
    tied: bool = True  # lives only as long as its agent
    cpuset: Optional[str] = None
    cpu_quota: Optional[float] = None  # in cores
    cgroup_parent: Optional[str] = None  # the agent's own where allowed: workers compete as local ones
    shm_size: str = "2g"

    IDENTITY = ("group", "run_id", "agent", "cpu_shares")

    @property
    def settings(self) -> Dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.IDENTITY}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(_plain(self.settings), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def labels(self) -> Dict[str, str]:
        return {
            LABEL_MANAGED: "1", LABEL_RUN_ID: self.run_id, LABEL_VENDOR: self.vendor, LABEL_GROUP: self.group,
            LABEL_AGENT_HOST: self.agent.host, LABEL_AGENT_PID: str(self.agent.pid),
            LABEL_AGENT_START: self.agent.start, LABEL_KEEP: "0" if self.tied else "1", LABEL_SPEC: self.digest,
        }

    @property
    def name(self) -> str:
        """A kept container outlives its run and serves any later one of the same shape: it names the shape."""
        if self.tied:
            return f"kaitian-{_sanitize(self.run_id)[:40]}-{_sanitize(self.group)}-{self.agent.pid}"
        return f"kaitian-{_sanitize(self.group)}-{self.digest[:12]}"

    def create_kwargs(self) -> Dict[str, object]:
        """``client.containers.create``'s arguments; a tied container is made as ``docker run -i --rm``."""
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


@dataclass(frozen=True)
class ExecSpec:
    """One worker as a ``docker exec`` into its group's container. ``stdout``/``stderr``: the log files
    (in a mount) the worker writes itself; ``""``: its output comes through the exec's stream."""

    local_rank: int
    group: str
    argv: Tuple[str, ...]  # the worker's program and arguments
    cpus: str  # the cores it is pinned to ("": none)
    env: Mapping[str, str]
    workdir: str
    user: str
    pid_file: str  # where the wrapper writes the in-container pid
    stdout: str = ""
    stderr: str = ""

    @property
    def cmd(self) -> Tuple[str, ...]:
        return ("sh", "-c", WRAPPER_SCRIPT, self.pid_file, self.cpus, self.stdout, self.stderr, *self.argv)

    def env_list(self) -> List[str]:
        return [f"{k}={v}" for k, v in self.env.items()]


@dataclass(frozen=True)
class ImageInfo:
    """What an image declares in its labels: host paths to mount, its python."""

    mounts: Tuple[Mount, ...] = ()
    python: str = "python3"


@dataclass(frozen=True)
class DockerHost:
    """What a start depends on outside itself, read by the runtime from the host and the engine.

    ``host_python``: the host interpreter's paths (such an entrypoint becomes the image's python);
    ``device_nodes``: those on this host (``None``: look in ``/dev``); ``agent_env``: what workers
    inherit beneath their own environments, as torch's subprocesses do.
    """

    run_id: str
    run_dir: str
    cwd: str
    log_dir: Optional[str]
    agent: AgentIdentity
    user: str
    hands_over: bool = False  # a root agent gives the workers' directories to their user
    images: Mapping[str, ImageInfo] = field(default_factory=dict)
    cgroup_parent: Optional[str] = None
    cpu_quotas: Mapping[str, float] = field(default_factory=dict)
    host_python: Tuple[str, ...] = ()
    device_nodes: Optional[Tuple[str, ...]] = None
    agent_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def pid_dir(self) -> str:
        return os.path.join(self.run_dir, "docker-pids")


@dataclass(frozen=True)
class DockerStart:
    """One start: containers (reused when one with the same labels and digest runs), the execs by the
    start's key, directories a root agent hands to the workers' user, and directories to make first."""

    containers: Tuple[ContainerSpec, ...]
    execs: Mapping[int, ExecSpec]
    hand_over: Tuple[str, ...] = ()
    make_dirs: Tuple[str, ...] = ()

    def to_text(self, inherited: Mapping[str, str] = {}) -> str:  # noqa: B006 (read only)
        """The plan as YAML (``--dry-run``); a worker's variable equal in ``inherited`` is left out."""
        lines = ["containers:"]
        for c in self.containers:
            lines.append(f"- name: {c.name}")
            lines += [f"  {k}: {json.dumps(_plain(v))}" for k, v in {
                **c.settings, "cpu_shares": c.cpu_shares, "digest": c.digest, "labels": c.labels}.items()]
        names = {c.group: c.name for c in self.containers}
        lines.append("execs:")
        for key in sorted(self.execs):
            ex = self.execs[key]
            lines.append(f"- local_rank: {ex.local_rank}")
            lines += [f"  {k}: {json.dumps(v)}" for k, v in (
                ("container", names[ex.group]), ("user", ex.user), ("workdir", ex.workdir),
                ("argv", list(ex.argv)), ("cpus", ex.cpus), ("pid_file", ex.pid_file), ("stdout", ex.stdout),
                ("stderr", ex.stderr))]
            lines.append("  env:  # besides the agent's own")
            lines += [f"    {k}: {json.dumps(ex.env[k])}" for k in sorted(ex.env) if inherited.get(k) != ex.env[k]]
        if self.hand_over:
            lines.append(f"hand_over: {json.dumps(list(self.hand_over))}")
        return "\n".join(lines)


@dataclass(frozen=True)
class LogFiles:
    """Where torch put one start's logs, by key (``""``: none); ``root``: the logs specs' root, if any."""

    root: Optional[str] = None
    stdouts: Mapping[int, str] = field(default_factory=dict)
    stderrs: Mapping[int, str] = field(default_factory=dict)
    error_files: Mapping[int, str] = field(default_factory=dict)


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
    """``--container-user``; else for a root agent in a user's project (``sudo kaitianrun``) the project's
    owner; else the agent itself, so workers write where local ones would."""
    if requested:
        return requested
    if agent_uid == 0 and cwd_owner[0] != 0:
        return f"{cwd_owner[0]}:{cwd_owner[1]}"
    return f"{agent_uid}:{agent_gid}"


def image_for(group: str, vendor: str, images: Mapping[str, str]) -> str:
    """``--image GROUP=…``, else ``--image VENDOR=…``, else the vendor table's image."""
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
    """The vendor of a group's container and the devices it holds (raises if it mixes vendors)."""
    vendors = {w.device.type for w in workers}
    if len(vendors) != 1:
        raise DockerOptionError(f"group {group!r} mixes device types {sorted(vendors)}; one vendor per group")
    vendor = vendors.pop()
    return vendor, vendor_entry(vendor).container_devices([w.device for w in workers], device_nodes)


def groups_of(workers: Mapping[int, LocalWorker]) -> Dict[str, List[LocalWorker]]:
    groups: Dict[str, List[LocalWorker]] = {}
    for key in sorted(workers):
        groups.setdefault(workers[key].device.group, []).append(workers[key])
    return groups


def as_binary(entrypoint: object, args: Mapping[int, Tuple]) -> Tuple[str, Dict[int, Tuple]]:
    """A program and its arguments: the entrypoint, or for torchrun's ``--run-path`` function ``python -c``."""
    if isinstance(entrypoint, str):
        return entrypoint, dict(args)
    if getattr(entrypoint, "__name__", "") == "run_script_path":
        return sys.executable, {r: ("-u", "-c", _RUN_PATH_CODE, *a) for r, a in args.items()}
    raise DockerOptionError(
        "the docker runtime starts programs (python scripts, --no-python binaries), not Python functions"
    )


def container_spec(
    *, group: str, workers: Sequence[LocalWorker], image: str, cpu_quota: Optional[float], run_id: str,
    run_dir: str, cwd: str, log_dirs: Iterable[str], options: DockerOptions, agent: AgentIdentity,
    user: str = ROOT_USER, image_mounts: Iterable[Mount] = (), device_nodes: Optional[Iterable[str]] = None,
    cgroup_parent: Optional[str] = None,
) -> ContainerSpec:
    """The container of one group; ``log_dirs``: host directories its workers write files to."""
    vendor, devices = group_devices(group, workers, device_nodes)
    all_cpus = [c for w in workers for c in w.cpus]
    mounts: Dict[str, Mount] = {m.target: m for m in image_mounts}
    # Exactly the run's own directories, never a parent (--log-dir /tmp/x mounts /tmp/x, not /tmp); one
    # inside another is visible already, and leaving it out keeps the shape (so reuse) stable.
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
        capabilities=ROOT_CAPABILITIES if options.user == ROOT_USER else (), tied=not options.keep_containers,
        # pinned only when every worker is
        cpuset=format_cpulist(all_cpus) if all_cpus and all(w.cpus for w in workers) else None,
        cpu_quota=cpu_quota, cgroup_parent=cgroup_parent, shm_size=options.shm_size,
    )


def container_env(env: Mapping[str, str], mounted: Sequence[str]) -> Dict[str, str]:
    """A worker's environment inside its container: no host-software variables, ``HOME`` on the tmpfs,
    ``TMPDIR`` only if it is mounted."""
    out = {k: v for k, v in env.items() if k not in HOST_ONLY_ENV}
    out["HOME"] = CONTAINER_HOME
    tmp = out.get("TMPDIR")
    if tmp and not any(inside(tmp, m) for m in mounted):
        del out["TMPDIR"]
    return out


def exec_spec(
    *, worker: LocalWorker, container: ContainerSpec, entrypoint: str, args: Sequence[object],
    env: Mapping[str, str], cwd: str, pid_file: str, stdout: str = "", stderr: str = "",
    host_python: Sequence[str] = (), image_python: str = "python3",
) -> ExecSpec:
    """The ``docker exec`` of one worker; a log file its container does not show is streamed instead."""
    program = image_python if entrypoint in set(host_python) else entrypoint
    cpus = format_cpulist(worker.cpus) if worker.cpus else ""
    mounted = [m.target for m in container.mounts]
    stdout, stderr = (path if path and any(inside(path, m) for m in mounted) else "" for path in (stdout, stderr))
    return ExecSpec(local_rank=worker.local_rank, group=container.group, argv=(program, *[str(a) for a in args]),
                    cpus=cpus, env=container_env(env, mounted), workdir=cwd, user=container.user, pid_file=pid_file,
                    stdout=stdout, stderr=stderr)


def docker_start(
    workers: Mapping[int, LocalWorker], entrypoint: object, args: Mapping[int, Tuple],
    envs: Mapping[int, Mapping[str, str]], logs: LogFiles, host: DockerHost, options: DockerOptions,
) -> DockerStart:
    """The plan of one start: a container per group of ``workers``, an exec per worker (by the start's key)."""
    program, args = as_binary(entrypoint, args)
    cwd = os.path.abspath(host.cwd)
    run_dir = os.path.abspath(host.run_dir)
    errors = [os.path.dirname(os.path.abspath(p)) for p in logs.error_files.values() if p and p != os.devnull]
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
        # What a non-root worker writes in: the run, start, pid and monitor directories, and those torch
        # made for error files below a log directory (never the user's --log-dir itself).
        writable = {run_dir, host.pid_dir, *monitor_dirs}
        writable |= {os.path.abspath(s.run_dir) for s in given if s.run_dir}
        roots = [run_dir, *log_dirs]
        for d in errors:
            while any(d != r and inside(d, r) for r in roots):
                writable.add(d)
                d = os.path.dirname(d)
        hand_over = tuple(sorted(writable))
    return DockerStart(tuple(containers.values()), execs, hand_over, tuple(sorted(monitor_dirs)))
