"""The docker runtime: each group's workers in its own container.

``kaitianrun --runtime docker`` keeps the elastic agent on the host and starts
workers inside one container per kaitian group (per vendor, or per simulated
CPU group) with ``docker exec``. Containers run an idle main process and are
reused across restarts of the worker group; workers are signalled as whole
process groups *inside* the container (the Engine API cannot kill an exec,
and killing the exec's client would leave the worker running).

A run's containers are tied to the agent's life: their main process reads
the agent's stdin attach, so when the agent dies (even by SIGKILL) the
engine closes it, the container stops, its workers die with its pid
namespace, and the engine removes it (``shell.MAIN_TIED``).

What to create is decided in ``specs`` (pure); this module carries it out:
the engine connection is ``client``, image labels ``images``, workers as
``docker exec`` processes ``exec``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from kaitian._torch import LogsSpecs, PContext
from kaitian.devices.device import ContainerDevices
from kaitian.errors import DockerOptionError, DockerRuntimeError, ImageNotFoundError
from kaitian.launcher.plan import LocalWorker
from kaitian.launcher.runtimes.base import RunContext, Runtime, WorkerStart
from kaitian.launcher.rundir import record_pid_namespace
from kaitian.launcher.runtimes.docker.client import (
    connect, find_one, is_not_found, list_containers, pid_namespace_of, remove_container,
)
from kaitian.launcher.runtimes.docker.exec import DockerExecContext
from kaitian.launcher.runtimes.docker.images import ImageInfo, image_info
from kaitian.launcher.runtimes.docker.labels import (
    LABEL_AGENT_HOST,
    LABEL_AGENT_PID,
    LABEL_GROUP,
    LABEL_KEEP,
    LABEL_MANAGED,
    LABEL_RUN_ID,
    LABEL_SPEC,
    agent_identity,
    owner_alive,
)
from kaitian.launcher.runtimes.docker.options import ROOT_USER, DockerOptions
from kaitian.launcher.runtimes.docker.paths import inside
from kaitian.launcher.runtimes.docker.specs import (
    ContainerSpec, ExecSpec, choose_user, container_spec, exec_spec, group_devices, image_for,
)
from kaitian.settings import Settings

__all__ = ["DockerRuntime", "DockerExecContext"]

logger = logging.getLogger(__name__)


def _grant(paths: List[str], user: str) -> None:
    """Hands directories the workers write in to their user (a root agent only).

    The agent creates them owner-only; a non-root worker must write its
    FileStore, pid file and error files there.
    """
    uid, _, gid = user.partition(":")
    for path in paths:
        try:
            os.chown(path, int(uid), int(gid or uid))
        except OSError as exc:
            logger.warning("could not hand %s to the container user %s: %s", path, user, exc)


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
    """Runs each group's workers in its own container.

    Args:
        ctx: the node's run context (its ``DockerOptions``: images, mounts,
            ``--keep-containers``, ``--shm-size``, ``--container-user``).
        client: a docker SDK client (tests); built from the environment if ``None``.
    """

    name = "docker"

    def __init__(self, ctx: RunContext, client: object = None) -> None:
        super().__init__(ctx)
        self.options: DockerOptions = ctx.options.of(self.name, DockerOptions)
        self._client = client
        self._connected = False
        self._agent = agent_identity()
        self._containers: Dict[str, str] = {}  # group -> container id, this run's
        self._ties: Dict[str, object] = {}  # container id -> the agent's stdin attach
        self._images: Dict[str, ImageInfo] = {}
        self._parent_cgroup: Optional[str] = None
        self.user = self._worker_user()

    @property
    def client(self) -> object:
        if self._client is None or not self._connected:
            self._client = connect(self._client)
            self._connected = True
        return self._client

    def _worker_user(self) -> str:
        st = os.stat(self.ctx.cwd)
        return choose_user(self.options.user, os.getuid(), os.getgid(), (st.st_uid, st.st_gid))

    @property
    def _hands_over(self) -> bool:
        """Whether the (root) agent must give the workers' directories to their user."""
        return os.getuid() == 0 and self.user != ROOT_USER

    # --- the contract --------------------------------------------------------

    def start(self, job: WorkerStart) -> PContext:
        """Creates or reuses the containers, then starts one ``docker exec`` per rank.

        Raises:
            DockerRuntimeError: (subclasses) the daemon, an image or an option
                is not usable; the message says what to do.
        """
        entrypoint, args = job.entrypoint, job.args
        if not isinstance(entrypoint, str):
            entrypoint, args = _as_binary(entrypoint, args)
        workers, logs_specs = job.workers, job.logs_specs
        client = self.client
        # Check images before anything is started, so a missing one fails alone.
        for w in workers.values():
            self._image(image_for(w.device.group, w.device.type, self.options.images))

        def prepare(pc: DockerExecContext) -> Dict[int, Tuple[ExecSpec, str]]:
            return self._prepare(pc, entrypoint, workers, logs_specs)

        pc = DockerExecContext(
            replace(job, entrypoint=entrypoint, args=args),
            prepare=prepare,
            client=client,
            duplicate_stdout_filters=self.ctx.options.duplicate_stdout_filters,
            duplicate_stderr_filters=self.ctx.options.duplicate_stderr_filters,
        )
        try:
            pc.start()
        except BaseException:  # (a Ctrl-C while the log tails start) the agent never sees this context
            pc.close()
            raise
        return pc

    def devices_seen(self, workers: Dict[int, LocalWorker]) -> Dict[int, ContainerDevices]:
        """Each worker sees its group's container's devices."""
        groups: Dict[str, List[LocalWorker]] = {}
        for key in sorted(workers):
            groups.setdefault(workers[key].device.group, []).append(workers[key])
        devices = {group: group_devices(group, members)[1] for group, members in groups.items()}
        return {key: devices[w.device.group] for key, w in workers.items()}

    def exit_codes(self, pcontext: PContext) -> Dict[int, Optional[int]]:
        return pcontext.exit_codes()

    def kill_worker(self, pcontext: PContext, key: int) -> None:
        pcontext.kill(key)

    def shutdown(self) -> None:
        """Removes this run's containers unless ``--keep-containers``. Idempotent."""
        if not self.options.keep_containers:
            for group, cid in list(self._containers.items()):
                try:
                    remove_container(self._client.containers.get(cid))
                    logger.info("removed container of group %s", group)
                except Exception as exc:  # noqa: BLE001
                    if not is_not_found(exc):
                        logger.warning("could not remove container %s: %s", cid[:12], exc)
        self._containers.clear()
        for tie in self._ties.values():
            try:
                tie.close()
            except OSError:
                pass
        self._ties.clear()

    @classmethod
    def collect_stale(cls, client: object = None) -> List[str]:
        """Removes containers whose agent on this host is gone; returns their names.

        A run's containers remove themselves when their agent dies; this
        catches those whose agent died before it could tie them. Kept
        containers (``--keep-containers``) are left alone: they are meant to
        outlive their run.

        Raises:
            DockerUnavailableError: the daemon cannot be reached.
        """
        client = connect(client)
        labels = {LABEL_MANAGED: "1", LABEL_KEEP: "0", LABEL_AGENT_HOST: socket.gethostname()}
        removed = []
        for c in list_containers(client, labels):
            if owner_alive(c.labels):
                continue
            try:
                remove_container(c)
                removed.append(c.name)
            except Exception as exc:  # noqa: BLE001
                if not is_not_found(exc):
                    logger.warning("could not remove stale container %s: %s", c.name, exc)
        return removed

    # --- helpers -------------------------------------------------------------

    def _image(self, ref: str) -> ImageInfo:
        if ref not in self._images:
            self._images[ref] = image_info(self.client, ref)
        return self._images[ref]

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

    def _state_dir(self) -> str:
        """The run state directory containers mount: this run's directory, or for
        kept containers the directory of all run directories (later runs' are
        new siblings there), so a kept container serves the next run too."""
        run_dir = os.path.abspath(self.ctx.run_dir)
        if not self.options.keep_containers:
            return run_dir
        base = os.path.dirname(run_dir)
        if self._hands_over:
            os.chmod(base, 0o711)  # traversable, not listable: run directories stay owner-only
        return base

    def _log_dirs(self, pc: DockerExecContext, logs_specs: LogsSpecs) -> List[str]:
        """Host directories workers write into (error files, monitor samples): exactly
        those, never a parent (``--log-dir /tmp/x`` is ``/tmp/x``, not ``/tmp``)."""
        dirs = set()
        try:
            root = logs_specs.root_log_dir
        except Exception:  # noqa: BLE001 (custom LogsSpecs without a root)
            root = None
        if root and root != os.devnull:
            dirs.add(os.path.abspath(root))
        for path in pc.error_files.values():
            if path and path != os.devnull:
                d = os.path.dirname(os.path.abspath(path))
                if not any(inside(d, m) for m in dirs):
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

    def _writable(self, pc: DockerExecContext, pid_dir: str, log_dirs: List[str]) -> List[str]:
        """Directories a non-root worker writes in: the run directory, this start's
        directory and pid directory, the monitor directory, and the directories
        torch made for error files below a log directory (never the user's
        ``--log-dir`` itself, never anything above it)."""
        run_dir = os.path.abspath(self.ctx.run_dir)
        paths = {run_dir, pid_dir}
        for env in pc.envs.values():
            given = Settings.from_env(env)
            if given.run_dir:
                paths.add(os.path.abspath(given.run_dir))
            if given.monitor_dir:
                paths.add(os.path.abspath(os.path.join(self.ctx.cwd, given.monitor_dir)))
        roots = [run_dir, *log_dirs]
        for path in pc.error_files.values():
            if not path or path == os.devnull:
                continue
            d = os.path.dirname(os.path.abspath(path))
            while any(d != r and inside(d, r) for r in roots):
                paths.add(d)
                d = os.path.dirname(d)
        return sorted(paths)

    def _prepare(
        self,
        pc: DockerExecContext,
        entrypoint: str,
        workers: Dict[int, LocalWorker],
        logs_specs: LogsSpecs,
    ) -> Dict[int, Tuple[ExecSpec, str]]:
        groups: Dict[str, List[LocalWorker]] = {}
        for rank in sorted(workers):
            groups.setdefault(workers[rank].device.group, []).append(workers[rank])
        log_dirs = self._log_dirs(pc, logs_specs)
        state_dir = self._state_dir()
        cwd = os.path.abspath(self.ctx.cwd)
        containers: Dict[str, ContainerSpec] = {}
        for group, members in groups.items():
            ref = image_for(group, members[0].device.type, self.options.images)
            containers[group] = container_spec(
                group=group,
                workers=members,
                image=ref,
                cpu_quota=self.ctx.cpu_quotas.get(group),
                run_id=self.ctx.run_id,
                run_dir=state_dir,
                cwd=cwd,
                log_dirs=log_dirs,
                options=self.options,
                agent=self._agent,
                user=self.user,
                image_mounts=self._image(ref).mounts,
                cgroup_parent=self._cgroup_parent(),
            )

        pid_dir = os.path.join(self.ctx.run_dir, "docker-pids")
        os.makedirs(pid_dir, mode=0o700, exist_ok=True)
        if self._hands_over:
            _grant(self._writable(pc, pid_dir, log_dirs), self.user)
        for group, container in containers.items():
            self._containers[group] = self._ensure(container)

        host_python = {sys.executable, os.path.abspath(sys.executable), os.path.realpath(sys.executable)}
        out: Dict[int, Tuple[ExecSpec, str]] = {}
        for rank, w in workers.items():
            container = containers[w.device.group]
            ex = exec_spec(
                worker=w,
                container=container,
                entrypoint=entrypoint,
                args=pc.args[rank],
                # Like torch's local subprocesses, workers inherit the agent's
                # environment under the variables the agent set.
                env={**os.environ, **pc.envs[rank]},
                cwd=cwd,
                pid_file=os.path.join(pid_dir, f"{w.local_rank}.pid"),  # a worker restarted alone is key 0
                stdout=pc.stdouts[rank],
                stderr=pc.stderrs[rank],
                host_python=sorted(host_python),
                image_python=self._image(container.image).python,
            )
            out[rank] = (ex, self._containers[w.device.group])
        return out

    def _ensure(self, spec: ContainerSpec) -> str:
        """The id of a running container matching ``spec``: reused or created."""
        client = self.client
        labels = spec.labels
        if self.options.keep_containers:
            key = {k: labels[k] for k in (LABEL_MANAGED, LABEL_KEEP, LABEL_GROUP, LABEL_SPEC, LABEL_AGENT_HOST)}
        else:
            key = {k: labels[k] for k in (LABEL_MANAGED, LABEL_RUN_ID, LABEL_GROUP, LABEL_AGENT_HOST, LABEL_AGENT_PID)}
        found = find_one(client, key)
        if found is not None and (found.labels.get(LABEL_SPEC) != spec.digest or (spec.tied and found.id not in self._ties)):
            logger.info("container %s no longer matches its group; recreating it", found.name)
            remove_container(found)
            found = None
        if found is not None:
            if found.status != "running":
                found.start()
            logger.info("reusing container %s", found.name)
            return found.id
        import docker.errors

        logger.info("creating container %s", spec.describe())
        try:
            container = client.containers.create(**spec.create_kwargs())
        except docker.errors.ImageNotFound:
            raise ImageNotFoundError(
                f"docker image {spec.image!r} not found on this host: build it (kaitian images build) "
                f"or choose another with --image {spec.group}=IMAGE"
            ) from None
        except docker.errors.APIError as exc:
            raise DockerRuntimeError(
                f"cannot create the container for group {spec.group!r}: {exc.explanation or exc}"
            ) from None
        try:
            if spec.tied:
                # Attached before it starts (as docker run -i): its stdin closes
                # when this process exits, however it exits.
                self._ties[container.id] = client.api.attach_socket(
                    container.id, params={"stdin": 1, "stream": 1}
                )
            container.start()
        except docker.errors.APIError as exc:
            remove_container(container)
            self._ties.pop(container.id, None)
            why = str(exc.explanation or exc)
            hint = ""
            if 'device driver "nvidia"' in why:
                hint = ("; install the NVIDIA container toolkit and configure docker for it "
                        "(nvidia-ctk runtime configure --runtime=docker, then restart dockerd)")
            raise DockerRuntimeError(
                f"cannot start the container for group {spec.group!r} ({spec.image}): {why}{hint}"
            ) from None
        pid_ns = pid_namespace_of(container)
        if pid_ns:
            record_pid_namespace(self.ctx.run_dir, pid_ns)
        return container.id
