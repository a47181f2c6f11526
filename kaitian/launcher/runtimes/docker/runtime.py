"""The docker runtime: each group's workers in its own long-lived container.

``kaitianrun --runtime docker`` keeps the elastic agent on the host and starts
workers inside one container per kaitian group (per vendor, or per simulated
CPU group) with ``docker exec``. Containers run an idle process and are reused
across restarts; workers are signalled as whole process groups *inside* the
container (the Engine API cannot kill an exec, and killing the exec's client
would leave the worker running).

What to create is decided in ``docker_plan`` (pure); this module carries it out
with the docker SDK, imported lazily and injectable for tests; workers as
``docker exec`` processes (start, logs, exit codes, stopping) live in
``docker_exec``.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import sys
from typing import Dict, List, Mapping, Optional, Tuple

from kaitian._torch import LogsSpecs, PContext
from kaitian.launcher.runtimes.base import RunContext, Runtime, WorkerLaunch
from kaitian.launcher.runtimes.docker.exec import DockerExecContext
from kaitian.launcher.runtimes.docker.plan import (
    LABEL_AGENT_HOST,
    LABEL_AGENT_PID,
    LABEL_AGENT_START,
    LABEL_GROUP,
    LABEL_HOST_MOUNTS,
    LABEL_KEEP,
    LABEL_MANAGED,
    LABEL_PYTHON,
    LABEL_RUN_ID,
    LABEL_SPEC,
    AgentIdentity,
    ContainerLookupError,
    ContainerPlan,
    DockerOptionError,
    DockerOptions,
    DockerRuntimeError,
    DockerUnavailableError,
    ExecPlan,
    ImageNotFoundError,
    Mount,
    image_for,
    parse_options,
    parse_volume,
    plan_container,
    plan_exec,
)
from kaitian.settings import Settings

__all__ = [
    "DockerRuntime",
    "DockerExecContext",
    "DockerRuntimeError",
    "DockerUnavailableError",
    "ImageNotFoundError",
    "ContainerLookupError",
    "DockerOptionError",
    "connect",
    "agent_identity",
    "owner_alive",
    "remove_container",
]

logger = logging.getLogger(__name__)


# The environment's client, once it has answered (the agent, its stale-container
# collection and its runtime share one connection).
_default_client: object = None


def connect(client: object = None) -> object:
    """A docker SDK client that has answered a ping.

    Args:
        client: an existing client (tests inject one); ``None`` builds one
            from the environment (``DOCKER_HOST`` …).

    Returns:
        The client.

    Raises:
        DockerUnavailableError: the SDK is missing, the daemon does not answer,
            or the socket refuses this user.
    """
    try:
        import docker
        import docker.errors
    except ImportError:
        raise DockerUnavailableError(
            "the docker runtime needs the docker SDK: pip install 'docker>=7'"
        ) from None
    import requests.exceptions

    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    denied = DockerUnavailableError(
        f"no permission on the Docker socket ({where}): add your user to the 'docker' group "
        "(sudo usermod -aG docker $USER, then log in again) or run as root"
    )
    global _default_client
    if client is None and _default_client is not None:
        return _default_client
    try:
        if client is None:
            client = docker.DockerClient.from_env(max_pool_size=64)
            client.ping()
            _default_client = client
        else:
            client.ping()
    except PermissionError:
        raise denied from None
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
        if "Permission denied" in str(exc) or isinstance(exc.__context__, PermissionError):
            raise denied from None
        raise DockerUnavailableError(
            f"cannot reach the Docker daemon at {where}: start it "
            "(sudo systemctl start docker, or bash scripts/docker-engine.sh) and retry"
        ) from None
    return client


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


def _pid_namespace_of(container: object) -> Optional[int]:
    """The pid namespace (inode) of a running container, if this host can see it."""
    try:
        container.reload()  # listed containers carry only a summary
        pid = int(container.attrs["State"]["Pid"] or 0)
        return os.stat(f"/proc/{pid}/ns/pid").st_ino if pid > 0 else None
    except Exception:  # noqa: BLE001 (gone already, another host, no permission: nothing to clean)
        return None


def remove_container(container: object) -> None:
    """Removes a container (killing what runs in it) and the kaitian shared-memory
    segments its processes left: their pid namespace is gone with it."""
    from kaitian.backend.shm_gc import collect_namespace_segments

    pid_ns = _pid_namespace_of(container)
    container.remove(force=True)
    if pid_ns:
        for name in collect_namespace_segments(pid_ns):
            logger.info("removed shared memory %s left in container %s", name, container.name)


def _label_filters(labels: Mapping[str, str]) -> Dict[str, List[str]]:
    return {"label": [f"{k}={v}" for k, v in labels.items()]}


def _find_one(client: object, labels: Mapping[str, str]) -> Optional[object]:
    """The one container carrying ``labels``; ``None`` if there is none.

    Raises:
        ContainerLookupError: several containers match.
    """
    found = client.containers.list(all=True, filters=_label_filters(labels))
    if len(found) > 1:
        names = ", ".join(sorted(c.name for c in found))
        raise ContainerLookupError(
            f"several kaitian containers match {dict(labels)}: {names}; "
            "remove the extra ones (docker rm -f NAME) and retry"
        )
    return found[0] if found else None


# `--run-path`: torchrun runs the script with runpy in the worker process; in a
# container the same happens in the image's python.
_RUN_PATH_CODE = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _as_binary(entrypoint: object, args: Dict[int, Tuple]) -> Tuple[str, Dict[int, Tuple]]:
    """The ``python -c`` equivalent of torchrun's ``--run-path`` function entrypoint.

    Raises:
        DockerOptionError: any other Python function (cannot cross into a container).
    """
    if getattr(entrypoint, "__name__", "") == "run_script_path":
        return sys.executable, {r: ("-u", "-c", _RUN_PATH_CODE, *a) for r, a in args.items()}
    raise DockerOptionError(
        "the docker runtime starts programs (python scripts, --no-python binaries), not Python functions"
    )


class DockerRuntime(Runtime):
    """Runs each group's workers in its own long-lived container.

    Args:
        ctx: the node's run context (``options``: ``images``,
            ``keep_containers``, ``volumes``, ``shm_size``).
        client: a docker SDK client (tests); built from the environment if ``None``.

    Raises:
        DockerOptionError: an option that cannot be used.
    """

    name = "docker"

    def __init__(self, ctx: RunContext, client: object = None) -> None:
        super().__init__(ctx)
        self.options: DockerOptions = parse_options(ctx.options)
        self._client = client
        self._agent = agent_identity()
        self._containers: Dict[str, str] = {}  # group -> container id, this run's
        self._image_info: Dict[str, Tuple[Tuple[Mount, ...], str]] = {}
        self._parent_cgroup: Optional[str] = None

    @property
    def client(self) -> object:
        if self._client is None or not getattr(self, "_connected", False):
            self._client = connect(self._client)
            self._connected = True
        return self._client

    # --- the contract --------------------------------------------------------

    def start(
        self,
        *,
        name: str,
        entrypoint: str,
        args: Dict[int, Tuple],
        envs: Dict[int, Dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: Optional[Dict[int, str]],
        start_method: str,
        workers: Dict[int, WorkerLaunch],
    ) -> PContext:
        """Creates or reuses the containers, then starts one ``docker exec`` per rank.

        Raises:
            DockerRuntimeError: (subclasses) the daemon, an image or an option
                is not usable; the message says what to do.
        """
        if not isinstance(entrypoint, str):
            entrypoint, args = _as_binary(entrypoint, args)
        client = self.client
        # Check images before anything is started, so a missing one fails alone.
        for w in workers.values():
            self._image(image_for(w.device.group, w.device.type, self.options.images))

        def prepare(pc: DockerExecContext) -> Dict[int, Tuple[ExecPlan, str]]:
            return self._prepare(pc, entrypoint, workers, logs_specs)

        pc = DockerExecContext(
            name=name,
            entrypoint=entrypoint,
            args=args,
            envs=envs,
            logs_specs=logs_specs,
            log_line_prefixes=log_line_prefixes,
            prepare=prepare,
            client=client,
            duplicate_stdout_filters=self.ctx.options.get("duplicate_stdout_filters"),  # type: ignore[arg-type]
            duplicate_stderr_filters=self.ctx.options.get("duplicate_stderr_filters"),  # type: ignore[arg-type]
        )
        pc.start()
        return pc

    def shutdown(self) -> None:
        """Removes this run's containers unless ``--keep-containers``. Idempotent."""
        if self.options.keep_containers or not self._containers:
            self._containers.clear()
            return
        client = self._client
        for group, cid in list(self._containers.items()):
            try:
                remove_container(client.containers.get(cid))
                logger.info("removed container of group %s", group)
            except Exception as exc:  # noqa: BLE001
                if type(exc).__name__ != "NotFound":
                    logger.warning("could not remove container %s: %s", cid[:12], exc)
            self._containers.pop(group, None)

    @classmethod
    def collect_stale(cls, client: object = None) -> List[str]:
        """Removes containers whose agent on this host is gone; returns their names.

        Kept containers (``--keep-containers``) are left alone: they are meant
        to outlive their run.

        Raises:
            DockerUnavailableError: the daemon cannot be reached.
        """
        client = connect(client)
        labels = {LABEL_MANAGED: "1", LABEL_KEEP: "0", LABEL_AGENT_HOST: socket.gethostname()}
        removed = []
        for c in client.containers.list(all=True, filters=_label_filters(labels)):
            if owner_alive(c.labels):
                continue
            try:
                remove_container(c)
                removed.append(c.name)
            except Exception as exc:  # noqa: BLE001
                if type(exc).__name__ != "NotFound":
                    logger.warning("could not remove stale container %s: %s", c.name, exc)
        return removed

    # --- helpers -------------------------------------------------------------

    def _image(self, ref: str) -> Tuple[Tuple[Mount, ...], str]:
        """The host mounts and python an image declares (its labels).

        Raises:
            ImageNotFoundError: the image is not on this host.
        """
        if ref in self._image_info:
            return self._image_info[ref]
        import docker.errors

        try:
            image = self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            raise ImageNotFoundError(
                f"docker image {ref!r} not found on this host: build it (kaitian images build), "
                f"pull it (docker pull {ref}) or choose another with --image VENDOR=IMAGE"
            ) from None
        labels = (image.attrs.get("Config") or {}).get("Labels") or {}
        mounts: Tuple[Mount, ...] = ()
        if labels.get(LABEL_HOST_MOUNTS):
            try:
                mounts = tuple(parse_volume(s) for s in labels[LABEL_HOST_MOUNTS].split(",") if s)
            except DockerOptionError as exc:
                raise DockerOptionError(f"image {ref!r} has a bad {LABEL_HOST_MOUNTS} label: {exc}") from None
        info = (mounts, labels.get(LABEL_PYTHON) or "python3")
        self._image_info[ref] = info
        return info

    def _cgroup_parent(self) -> Optional[str]:
        """The agent's own cgroup, if containers can be created in it.

        Only with the ``cgroupfs`` driver on cgroup v1: the systemd driver wants
        a slice, and cgroup v2 forbids child groups next to processes.
        """
        if self._parent_cgroup is None:
            self._parent_cgroup = ""
            try:
                info = self.client.info()
                if info.get("CgroupDriver") == "cgroupfs" and str(info.get("CgroupVersion", "1")) == "1":
                    with open("/proc/self/cgroup") as f:
                        for line in f:
                            _, controllers, path = line.rstrip("\n").split(":", 2)
                            if "cpu" in controllers.split(","):
                                self._parent_cgroup = path
                                break
            except Exception:  # noqa: BLE001 (keep the engine's default)
                self._parent_cgroup = ""
        return self._parent_cgroup or None

    @staticmethod
    def _mount_dir(path: str) -> str:
        """The directory mounted for a run or log directory: its parent, so kept
        containers also serve later runs (whose directories are new siblings)."""
        path = os.path.abspath(path)
        parent = os.path.dirname(path)
        return parent if parent not in ("", "/") else path

    def _log_dirs(self, pc: DockerExecContext, logs_specs: LogsSpecs) -> List[str]:
        """Host directories workers write into (error files, monitor samples)."""
        dirs = set()
        try:
            root = logs_specs.root_log_dir
        except Exception:  # noqa: BLE001 (custom LogsSpecs without a root)
            root = None
        if root and root != os.devnull:
            dirs.add(self._mount_dir(root))
        for path in pc.error_files.values():
            if path and path != os.devnull:
                d = os.path.dirname(os.path.abspath(path))
                if not any(d == m or d.startswith(m.rstrip("/") + "/") for m in dirs):
                    dirs.add(d)
        if self.ctx.log_dir:
            dirs.add(os.path.abspath(self.ctx.log_dir))
        # kaitianrun --monitor: ranks write their samples there.
        for env in pc.envs.values():
            monitor_dir = Settings.from_env(env).monitor_dir
            if monitor_dir:
                monitor_dir = os.path.abspath(os.path.join(self.ctx.cwd, monitor_dir))
                os.makedirs(monitor_dir, exist_ok=True)
                dirs.add(monitor_dir)
        return sorted(dirs)

    def _prepare(
        self,
        pc: DockerExecContext,
        entrypoint: str,
        workers: Dict[int, WorkerLaunch],
        logs_specs: LogsSpecs,
    ) -> Dict[int, Tuple[ExecPlan, str]]:
        groups: Dict[str, List[WorkerLaunch]] = {}
        for rank in sorted(workers):
            groups.setdefault(workers[rank].device.group, []).append(workers[rank])
        log_dirs = self._log_dirs(pc, logs_specs)
        run_mount = self._mount_dir(self.ctx.run_dir)
        device_nodes = glob.glob("/dev/cambricon*") + glob.glob("/dev/ipcm*")
        plans: Dict[str, ContainerPlan] = {}
        pythons: Dict[str, str] = {}
        for group, members in groups.items():
            ref = image_for(group, members[0].device.type, self.options.images)
            mounts, python = self._image(ref)
            plans[group] = plan_container(
                group=group,
                workers=members,
                image=ref,
                run_id=self.ctx.run_id,
                run_dir=run_mount,
                cwd=os.path.abspath(self.ctx.cwd),
                log_dirs=log_dirs,
                options=self.options,
                agent=self._agent,
                image_mounts=mounts,
                device_nodes=device_nodes,
                cgroup_parent=self._cgroup_parent(),
            )
            pythons[group] = python
        for group, plan in plans.items():
            self._containers[group] = self._ensure(plan)

        pid_dir = os.path.join(self.ctx.run_dir, "docker-pids")
        os.makedirs(pid_dir, mode=0o700, exist_ok=True)
        host_python = {sys.executable, os.path.realpath(sys.executable)}
        user = f"{os.getuid()}:{os.getgid()}"
        out: Dict[int, Tuple[ExecPlan, str]] = {}
        for rank, w in workers.items():
            plan = plans[w.device.group]
            ex = plan_exec(
                worker=w,
                container=plan,
                entrypoint=entrypoint,
                args=pc.args[rank],
                # Like torch's local subprocesses, workers inherit the agent's
                # environment under the variables the agent set.
                env={**os.environ, **pc.envs[rank]},
                cwd=os.path.abspath(self.ctx.cwd),
                pid_file=os.path.join(pid_dir, f"{rank}.pid"),
                user=user,
                host_python=sorted(host_python),
                image_python=pythons[w.device.group],
            )
            out[rank] = (ex, self._containers[w.device.group])
        return out

    def _ensure(self, plan: ContainerPlan) -> str:
        """The id of a running container matching ``plan``: reused or created."""
        client = self.client
        labels = plan.labels
        if self.options.keep_containers:
            key = {k: labels[k] for k in (LABEL_MANAGED, LABEL_KEEP, LABEL_GROUP, LABEL_SPEC, LABEL_AGENT_HOST)}
        else:
            key = {k: labels[k] for k in (LABEL_MANAGED, LABEL_RUN_ID, LABEL_GROUP, LABEL_AGENT_HOST, LABEL_AGENT_PID)}
        found = _find_one(client, key)
        if found is not None and found.labels.get(LABEL_SPEC) != plan.spec:
            logger.info("container %s no longer matches its group; recreating it", found.name)
            remove_container(found)
            found = None
        if found is not None:
            if found.status != "running":
                found.start()
            logger.info("reusing container %s", found.name)
            return found.id
        import docker.errors

        logger.info("creating container %s", plan.describe())
        try:
            container = client.containers.create(**plan.create_kwargs())
        except docker.errors.ImageNotFound:
            raise ImageNotFoundError(
                f"docker image {plan.image!r} not found on this host: build it (kaitian images build) "
                f"or choose another with --image {plan.group}=IMAGE"
            ) from None
        except docker.errors.APIError as exc:
            raise DockerRuntimeError(
                f"cannot create the container for group {plan.group!r}: {exc.explanation or exc}"
            ) from None
        try:
            container.start()
        except docker.errors.APIError as exc:
            container.remove(force=True)
            why = str(exc.explanation or exc)
            hint = ""
            if 'device driver "nvidia"' in why:
                hint = ("; install the NVIDIA container toolkit and configure docker for it "
                        "(nvidia-ctk runtime configure --runtime=docker, then restart dockerd)")
            raise DockerRuntimeError(
                f"cannot start the container for group {plan.group!r} ({plan.image}): {why}{hint}"
            ) from None
        return container.id
