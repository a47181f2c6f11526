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

What to create and exec is planned in ``start`` (pure, printable); this module
reads what the plan depends on (image labels, the engine's cgroup driver) and
carries it out: the engine connection is ``client``, workers as ``docker exec``
processes ``exec``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from kaitian._torch import PContext
from kaitian.devices.device import ContainerDevices
from kaitian.errors import DockerRuntimeError, ImageNotFoundError
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.rundir import process_start_time, record_pid_namespace
from kaitian.launcher.runtimes.base import RunContext, Runtime, WorkerStart
from kaitian.launcher.runtimes.docker.client import (
    connect, find_one, image_info, is_not_found, list_containers, pid_namespace_of, remove_container,
)
from kaitian.launcher.runtimes.docker.exec import DockerExecContext
from kaitian.launcher.runtimes.docker.options import ROOT_USER, DockerOptions
from kaitian.launcher.runtimes.docker import start as start_module
from kaitian.launcher.runtimes.docker.start import (
    LABEL_AGENT_HOST, LABEL_AGENT_PID, LABEL_AGENT_START, LABEL_GROUP, LABEL_KEEP, LABEL_MANAGED, LABEL_RUN_ID,
    LABEL_SPEC, AgentIdentity, ContainerSpec, DockerHost, DockerStart, ExecSpec, ImageInfo, LogFiles, as_binary, choose_user,
    group_devices, groups_of, image_for,
)

__all__ = ["DockerRuntime", "DockerExecContext"]

logger = logging.getLogger(__name__)


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
        """Plans the start (:func:`~kaitian.launcher.runtimes.docker.start.docker_start`),
        creates or reuses its containers, then starts one ``docker exec`` per worker.

        Raises:
            DockerRuntimeError: (subclasses) the daemon, an image or an option
                is not usable; the message says what to do.
        """
        entrypoint, args = as_binary(job.entrypoint, job.args)
        job = replace(job, entrypoint=entrypoint, args=args)
        client = self.client
        self._host(job.workers)  # images checked before anything is started, so a missing one fails alone

        def prepare(pc: DockerExecContext) -> Dict[int, Tuple[ExecSpec, str]]:
            logs = LogFiles(_root_log_dir(job), pc.stdouts, pc.stderrs, pc.error_files)
            return self._carry_out(self.docker_start(job, logs))

        pc = DockerExecContext(
            job,
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

    def docker_start(self, job: WorkerStart, logs: LogFiles) -> DockerStart:
        """What starting ``job`` creates and execs (reads image labels; changes nothing)."""
        return start_module.docker_start(job.workers, job.entrypoint, job.args, job.envs, logs,
                                         self._host(job.workers), self.options)

    def devices_seen(self, workers: Dict[int, LocalWorker]) -> Dict[int, ContainerDevices]:
        """Each worker sees its group's container's devices."""
        devices = {group: group_devices(group, members)[1] for group, members in groups_of(workers).items()}
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

    def _host(self, workers: Dict[int, LocalWorker]) -> DockerHost:
        """What the plan of a start of ``workers`` depends on outside it.

        Raises:
            ImageNotFoundError: a group's image is not on this host.
        """
        refs = {image_for(g, members[0].device.type, self.options.images) for g, members in groups_of(workers).items()}
        python = sys.executable
        return DockerHost(
            run_id=self.ctx.run_id, run_dir=self.ctx.run_dir, cwd=self.ctx.cwd, log_dir=self.ctx.log_dir,
            agent=self._agent, user=self.user, hands_over=self._hands_over,
            images={ref: self._image(ref) for ref in sorted(refs)}, cgroup_parent=self._cgroup_parent(),
            cpu_quotas=self.ctx.cpu_quotas,
            host_python=tuple(sorted({python, os.path.abspath(python), os.path.realpath(python)})),
            agent_env=dict(os.environ),
        )

    def _carry_out(self, plan: DockerStart) -> Dict[int, Tuple[ExecSpec, str]]:
        """Makes the plan's directories and containers: each worker's exec and its container's id."""
        for path in plan.make_dirs:
            os.makedirs(path, exist_ok=True)
        if self.options.keep_containers and self._hands_over:
            # Kept containers mount the directory of all run directories:
            # traversable, not listable, so run directories stay owner-only.
            os.chmod(os.path.dirname(os.path.abspath(self.ctx.run_dir)), 0o711)
        os.makedirs(os.path.join(self.ctx.run_dir, "docker-pids"), mode=0o700, exist_ok=True)
        for path in plan.hand_over:  # a root agent made them owner-only: the workers' user must write there
            uid, _, gid = self.user.partition(":")
            try:
                os.chown(path, int(uid), int(gid or uid))
            except OSError as exc:
                logger.warning("could not hand %s to the container user %s: %s", path, self.user, exc)
        for container in plan.containers:
            self._containers[container.group] = self._ensure(container)
        return {key: (ex, self._containers[ex.group]) for key, ex in plan.execs.items()}

    def _ensure(self, spec: ContainerSpec) -> str:
        """The id of a running container matching ``spec``: reused or created."""
        client = self.client
        labels = spec.labels
        digest = spec.digest
        if self.options.keep_containers:
            key = {k: labels[k] for k in (LABEL_MANAGED, LABEL_KEEP, LABEL_GROUP, LABEL_SPEC, LABEL_AGENT_HOST)}
        else:
            key = {k: labels[k] for k in (LABEL_MANAGED, LABEL_RUN_ID, LABEL_GROUP, LABEL_AGENT_HOST, LABEL_AGENT_PID)}
        found = find_one(client, key)
        if found is not None and (found.labels.get(LABEL_SPEC) != digest or (spec.tied and found.id not in self._ties)):
            logger.info("container %s no longer matches its group; recreating it", found.name)
            remove_container(found)
            found = None
        if found is not None:
            if found.status != "running":
                found.start()
            logger.info("reusing container %s", found.name)
            return found.id
        import docker.errors

        logger.info("creating container %s (%s, user %s)", spec.name, spec.image, spec.user)
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


def agent_identity() -> AgentIdentity:
    """This agent's host, pid and process start time (labels its containers)."""
    start = process_start_time(os.getpid())
    return AgentIdentity(socket.gethostname(), os.getpid(), "0" if start is None else f"{start:.0f}")


def owner_alive(labels: Dict[str, str]) -> bool:
    """Whether the agent named in a container's labels still runs on this host."""
    try:
        start = process_start_time(int(labels.get(LABEL_AGENT_PID, "")))
    except ValueError:
        return False
    return start is not None and f"{start:.0f}" == labels.get(LABEL_AGENT_START)


def _root_log_dir(job: WorkerStart) -> Optional[str]:
    try:
        return job.logs_specs.root_log_dir
    except Exception:  # noqa: BLE001 (custom LogsSpecs without a root)
        return None
