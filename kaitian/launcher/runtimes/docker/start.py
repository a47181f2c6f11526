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

from kaitian import _torch as _te
from kaitian.devices.device import ContainerDevices
from kaitian.devices.inventory import format_cpulist
from kaitian.devices.vendors import VENDORS, vendor as vendor_entry
from kaitian.errors import DockerOptionError
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.runtimes.base import RunContext, WorkerStart
from kaitian.launcher.runtimes.cpu_limits import CPU_PERIOD_US, cfs_limits
from kaitian.launcher.runtimes.docker.options import DEFAULT_SHM_SIZE, ROOT_USER, DockerOptions, Mount
from kaitian.settings import Settings

__all__ = ["AgentIdentity", "ContainerSpec", "ExecSpec", "ImageInfo", "DockerHost", "DockerStart", "LogFiles",
           "docker_start", "container_spec", "exec_spec", "choose_user", "as_binary", "outermost"]

# Labels are the only state kept outside the agent: a container's run, group, shape (spec) and owning
# agent (a later agent tells a live owner from a dead one); an image's host mounts and python.
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

# A run's container lives while the agent's stdin attach is open: however the agent dies, the engine
# closes it and the container stops and is removed.
MAIN_TIED = ("sh", "-c", "while read -r _; do :; done")
MAIN_KEPT = ("sleep", "infinity")  # --keep-containers: outlives its agent
# Every worker's exec: records its in-container pid (= its process group: an exec starts a session;
# elsewhere setsid makes one), writes straight to its log files if it has them (the exec stream can
# drop a dying process's last lines), pins its cores, then becomes the worker. POSIX sh: any image.
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

# Root asked for by name (--container-user root) may write a non-root agent's owner-only directories.
ROOT_CAPABILITIES = ("DAC_OVERRIDE",)
TMPFS = {"/tmp": "rw,nosuid,nodev,mode=1777"}  # the read-only container's writable /tmp and HOME
CONTAINER_HOME = "/tmp"
# Variables of the host's software, not of the job: the image has its own.
HOST_ONLY_ENV = frozenset({
    "PATH", "HOME", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "LD_LIBRARY_PATH", "LD_PRELOAD",
    "PYTHONHOME", "PYTHONEXECUTABLE", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_EXE",
    "CONDA_PYTHON_EXE", "CONDA_SHLVL", "PYENV_VERSION", "PYENV_DIR", "PYENV_ROOT", "PYENV_HOOK_PATH", "PYENV_SHELL",
})
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")


@dataclass(frozen=True)
class AgentIdentity:
    """A container's owner: host, pid and process start time (a recycled pid is not it)."""

    host: str
    pid: int
    start: str


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or below it (absolute, normalised paths)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def outermost(paths: Iterable[str]) -> List[str]:
    """The paths not inside another of them, shortest first."""
    kept: List[str] = []
    for path in sorted(set(paths), key=len):
        if not any(inside(path, k) for k in kept):
            kept.append(path)
    return kept


@dataclass(frozen=True)
class ContainerSpec:
    """One group's container: its digest covers every field but ``IDENTITY``, which names its owner rather
    than shapes it (a kept container serves later runs)."""

    group: str
    run_id: str
    agent: AgentIdentity
    cpu_shares: int  # 1024 a worker, as many local processes; a worker restarted alone joins the container
    image: str
    vendor: str
    mounts: Tuple[Mount, ...]
    devices: ContainerDevices = field(default_factory=ContainerDevices)
    user: str = ROOT_USER
    capabilities: Tuple[str, ...] = ()
    tied: bool = True  # lives as long as its agent
    cpuset: Optional[str] = None
    cpu_quota: Optional[float] = None  # in cores
    cpu_period_us: int = CPU_PERIOD_US  # the local runtime's: as uniformly slow as a local worker
    cgroup_parent: Optional[str] = None  # the agent's own where allowed: workers compete as local ones
    shm_size: str = DEFAULT_SHM_SIZE

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
    def lookup_labels(self) -> Dict[str, str]:
        """The labels that find this container again: a kept one by its shape, a run's by its run and agent."""
        if self.tied:
            keys = (LABEL_MANAGED, LABEL_RUN_ID, LABEL_GROUP, LABEL_AGENT_HOST, LABEL_AGENT_PID)
        else:
            keys = (LABEL_MANAGED, LABEL_KEEP, LABEL_GROUP, LABEL_SPEC, LABEL_AGENT_HOST)
        labels = self.labels
        return {k: labels[k] for k in keys}

    @property
    def name(self) -> str:
        """A kept container serves any later run of the same shape: it names the shape."""
        if self.tied:
            return f"kaitian-{_sanitize(self.run_id)[:40]}-{_sanitize(self.group)}-{self.agent.pid}"
        return f"kaitian-{_sanitize(self.group)}-{self.digest[:12]}"

    def create_kwargs(self) -> Dict[str, object]:
        """``client.containers.create``'s arguments: a tied container as ``docker run -i --rm``."""
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
            kwargs["cpu_period"], kwargs["cpu_quota"] = cfs_limits(self.cpu_quota, self.cpu_period_us)
        return kwargs


@dataclass(frozen=True)
class ExecSpec:
    """One worker's ``docker exec``. ``stdout``/``stderr``: log files (in a mount) the worker writes
    itself; ``""``: its output comes through the exec's stream."""

    local_rank: int
    group: str
    env: Mapping[str, str]
    user: str
    workdir: str
    argv: Tuple[str, ...]
    cpus: str  # its cores ("": not pinned)
    pid_file: str  # its in-container pid
    stdout: str = ""
    stderr: str = ""

    @property
    def cmd(self) -> Tuple[str, ...]:
        return ("sh", "-c", WRAPPER_SCRIPT, self.pid_file, self.cpus, self.stdout, self.stderr, *self.argv)


@dataclass(frozen=True)
class ImageInfo:
    """An image's labels: host paths to mount, its python."""

    mounts: Tuple[Mount, ...] = ()
    python: str = "python3"


@dataclass(frozen=True)
class DockerHost:
    """A start's inputs besides its workers: the run, and what the runtime read of the host and engine.
    ``host_python``: the host interpreter's paths (such an entrypoint becomes the image's python);
    ``device_nodes``: ``None``: those in ``/dev``; ``agent_env``: what workers inherit, as torch's do."""

    run: RunContext
    agent: AgentIdentity
    user: str
    hands_over: bool = False  # a root agent gives the workers' directories to their (other) user
    images: Mapping[str, ImageInfo] = field(default_factory=dict)
    cgroup_parent: Optional[str] = None
    host_python: Tuple[str, ...] = ()
    device_nodes: Optional[Tuple[str, ...]] = None
    agent_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def pid_dir(self) -> str:
        return os.path.join(self.run.run_dir, "docker-pids")

    def image(self, ref: str) -> ImageInfo:
        return self.images.get(ref, ImageInfo())


@dataclass(frozen=True)
class DockerStart:
    """One start: containers, the execs by the start's key, directories a root agent hands to the
    workers' user, and directories to make first."""

    containers: Tuple[ContainerSpec, ...]
    execs: Mapping[int, ExecSpec]
    hand_over: Tuple[str, ...] = ()
    make_dirs: Tuple[str, ...] = ()

    def to_text(self, inherited: Mapping[str, str] = {}) -> str:  # noqa: B006 (read only)
        """The plan as YAML (``--dry-run``); a worker's variable equal in ``inherited`` is left out."""
        lines = ["containers:"]
        for c in self.containers:
            lines += [f"- name: {c.name}", *_yaml({**c.settings, "cpu_shares": c.cpu_shares, "digest": c.digest,
                                                  "labels": c.labels})]
        names = {c.group: c.name for c in self.containers}
        lines.append("execs:")
        for ex in (self.execs[key] for key in sorted(self.execs)):
            shown = {k: v for k, v in vars(ex).items() if k not in ("local_rank", "group", "env")}
            env = {k: ex.env[k] for k in sorted(ex.env) if inherited.get(k) != ex.env[k]}
            lines += [f"- local_rank: {ex.local_rank}", *_yaml({"container": names[ex.group], **shown}),
                      "  env:  # besides the agent's own", *_yaml(env, "    ")]
        if self.hand_over:
            lines.append(f"hand_over: {json.dumps(list(self.hand_over))}")
        return "\n".join(lines)


@dataclass(frozen=True)
class LogFiles:
    """Where torch put one start's logs, by key."""

    stdouts: Mapping[int, str] = field(default_factory=dict)
    stderrs: Mapping[int, str] = field(default_factory=dict)
    error_files: Mapping[int, str] = field(default_factory=dict)


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _yaml(fields: Mapping[str, object], indent: str = "  ") -> List[str]:
    return [f"{indent}{k}: {json.dumps(_plain(v))}" for k, v in fields.items()]


def _sanitize(text: str) -> str:
    return _NAME_UNSAFE.sub("-", text).strip("-.") or "x"


def choose_user(requested: Optional[str], agent_uid: int, agent_gid: int, cwd_owner: Tuple[int, int]) -> str:
    """``--container-user``; else for a root agent in a user's project (``sudo kaitianrun``) its owner;
    else the agent, so workers write where local ones would."""
    if requested:
        return requested
    if agent_uid == 0 and cwd_owner[0] != 0:
        return f"{cwd_owner[0]}:{cwd_owner[1]}"
    return f"{agent_uid}:{agent_gid}"


def image_for(group: str, vendor: str, images: Mapping[str, str]) -> str:
    ref = images.get(group) or images.get(vendor) or getattr(VENDORS.get(vendor), "image", None)
    if ref is None:
        raise DockerOptionError(f"no image for device type {vendor!r}: pass --image {vendor}=IMAGE[:TAG]")
    return ref


def group_devices(group: str, workers: Sequence[LocalWorker],
                  device_nodes: Optional[Iterable[str]] = None) -> Tuple[str, ContainerDevices]:
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
    """A program and its arguments (torchrun's ``--run-path`` function: ``python -c``)."""
    if isinstance(entrypoint, str):
        return entrypoint, dict(args)
    if _te.is_run_script_path(entrypoint):  # in the image's python
        return sys.executable, {r: ("-u", "-c", _te.RUN_SCRIPT_PATH_CODE, *a) for r, a in args.items()}
    raise DockerOptionError(
        "the docker runtime starts programs (python scripts, --no-python binaries), not Python functions"
    )


def container_spec(group: str, workers: Sequence[LocalWorker], host: DockerHost, options: DockerOptions,
                   log_dirs: Iterable[str] = ()) -> ContainerSpec:
    """``log_dirs``: host directories its workers write files to."""
    vendor, devices = group_devices(group, workers, host.device_nodes)
    image = image_for(group, vendor, options.images)
    mounts = {m.target: m for m in host.image(image).mounts}
    run_dir = os.path.abspath(host.run.run_dir)
    # kept containers mount the directory of all run directories: later runs' are new siblings there
    state_dir = os.path.dirname(run_dir) if options.keep_containers else run_dir
    # Exactly the run's own directories, never a parent (--log-dir /tmp/x mounts /tmp/x, not /tmp); one
    # inside another is visible already, and leaving it out keeps the shape (so reuse) stable.
    own = {os.path.abspath(p) for p in (host.run.cwd, state_dir, *log_dirs) if p and p != os.devnull}
    if "/" in own:
        raise DockerOptionError(
            "the docker runtime mounts the working and log directories into the containers; "
            "run kaitianrun from a project directory (and give --log-dir a directory), not /"
        )
    for path in outermost(own):
        mounts[path] = Mount(path, path, False)
    for m in options.volumes:
        mounts[m.target] = m
    cpus = [c for w in workers for c in w.cpus]
    return ContainerSpec(
        group=group, run_id=host.run.run_id, agent=host.agent, cpu_shares=1024 * len(workers), image=image,
        vendor=vendor, mounts=tuple(mounts[t] for t in sorted(mounts)), devices=devices, user=host.user,
        capabilities=ROOT_CAPABILITIES if options.user == ROOT_USER else (), tied=not options.keep_containers,
        # pinned only when every worker is
        cpuset=format_cpulist(cpus) if cpus and all(w.cpus for w in workers) else None,
        cpu_quota=host.run.cpu_quotas.get(group), cgroup_parent=host.cgroup_parent, shm_size=options.shm_size,
    )


def exec_spec(worker: LocalWorker, container: ContainerSpec, argv: Sequence[object], env: Mapping[str, str],
              host: DockerHost, stdout: str = "", stderr: str = "") -> ExecSpec:
    """``env`` over the agent's, less the host software's; ``TMPDIR`` and log files only if mounted."""
    def shown(path: str) -> str:
        return path if path and any(inside(path, m.target) for m in container.mounts) else ""

    env = {k: v for k, v in {**host.agent_env, **env}.items() if k not in HOST_ONLY_ENV}
    env["HOME"] = CONTAINER_HOME
    if env.get("TMPDIR") and not shown(env["TMPDIR"]):
        del env["TMPDIR"]
    program = host.image(container.image).python if argv[0] in host.host_python else str(argv[0])
    return ExecSpec(
        local_rank=worker.local_rank, group=container.group, env=env, user=container.user,
        workdir=os.path.abspath(host.run.cwd), argv=(program, *map(str, argv[1:])),
        cpus=format_cpulist(worker.cpus) if worker.cpus else "",
        pid_file=os.path.join(host.pid_dir, f"{worker.local_rank}.pid"),  # a worker restarted alone is key 0
        stdout=shown(stdout), stderr=shown(stderr),
    )


def docker_start(job: WorkerStart, logs: LogFiles, host: DockerHost, options: DockerOptions) -> DockerStart:
    program, args = as_binary(job.entrypoint, job.args)
    run_dir = os.path.abspath(host.run.run_dir)
    errors = [os.path.dirname(os.path.abspath(p)) for p in logs.error_files.values() if p and p != os.devnull]
    root = getattr(job.logs_specs, "root_log_dir", None)  # custom LogsSpecs may have none
    log_dirs = {os.path.abspath(root)} if root and root != os.devnull else set()
    log_dirs |= {d for d in errors if not any(inside(d, m) for m in log_dirs)}
    if host.run.log_dir:
        log_dirs.add(os.path.abspath(host.run.log_dir))
    given = [Settings.from_env(env) for env in job.envs.values()]
    cwd = os.path.abspath(host.run.cwd)
    monitor_dirs = {os.path.abspath(os.path.join(cwd, s.monitor_dir)) for s in given if s.monitor_dir}
    log_dirs |= monitor_dirs  # kaitianrun --monitor: ranks write their samples there

    containers = {group: container_spec(group, members, host, options, sorted(log_dirs))
                  for group, members in groups_of(job.workers).items()}
    execs = {key: exec_spec(w, containers[w.device.group], (program, *args[key]), job.envs[key], host,
                            logs.stdouts.get(key, ""), logs.stderrs.get(key, ""))
             for key, w in job.workers.items()}
    hand_over: Tuple[str, ...] = ()
    if host.hands_over:
        # what a non-root worker writes in: the run, start, pid and monitor directories, and those torch
        # made for error files below a log directory (never the user's --log-dir itself)
        writable = {run_dir, host.pid_dir, *monitor_dirs}
        writable |= {os.path.abspath(s.run_dir) for s in given if s.run_dir}
        roots = [run_dir, *log_dirs]
        for d in errors:
            while any(d != r and inside(d, r) for r in roots):
                writable.add(d)
                d = os.path.dirname(d)
        hand_over = tuple(sorted(writable))
    return DockerStart(tuple(containers.values()), execs, hand_over, tuple(sorted(monitor_dirs)))
