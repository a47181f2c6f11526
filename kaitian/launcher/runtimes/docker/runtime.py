"""The docker runtime: carries out each start's plan (``start``) against the Docker engine.

Workers run as ``docker exec`` (``exec``) in one container per kaitian group, reused across restarts
of the group and tied to the agent's life. The docker SDK is imported on first use, so ``kaitianrun``
without ``--runtime docker`` never needs it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sys
from dataclasses import replace
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from kaitian._torch import PContext
from kaitian.backend.shm_gc import collect_namespace_segments, pid_namespace
from kaitian.devices.device import ContainerDevices
from kaitian.docker_client import connect
from kaitian.errors import ContainerLookupError, DockerOptionError, DockerRuntimeError, ImageNotFoundError
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.rundir import process_alive, process_start_time, record_pid_namespace
from kaitian.launcher.runtimes.base import RunContext, Runtime, WorkerStart
from kaitian.launcher.runtimes.docker.exec import DockerExecContext
from kaitian.launcher.runtimes.docker.options import ROOT_USER, DockerOptions, parse_volume
from kaitian.launcher.runtimes.docker.start import (
    LABEL_AGENT_HOST, LABEL_AGENT_PID, LABEL_AGENT_START, LABEL_HOST_MOUNTS, LABEL_KEEP, LABEL_MANAGED, LABEL_PYTHON,
    LABEL_SPEC, AgentIdentity, ContainerSpec, DockerHost, DockerStart, ExecSpec, ImageInfo, LogFiles, as_binary,
    choose_user, docker_start, group_devices, groups_of, image_for,
)

__all__ = ["DockerRuntime", "list_containers", "remove_container"]

logger = logging.getLogger(__name__)


def _not_found(exc: BaseException) -> bool:
    return type(exc).__name__ == "NotFound"


def _pid_namespace(container: object) -> int:
    try:
        container.reload()  # listed containers carry only a summary
        pid = int(container.attrs["State"]["Pid"] or 0)
    except Exception:  # noqa: BLE001 (gone already, another host, no permission: nothing to clean)
        return 0
    return pid_namespace(pid) if pid > 0 else 0


def remove_container(container: object) -> None:
    """Removes a container and the kaitian shared memory its pid namespace left."""
    pid_ns = _pid_namespace(container)
    try:
        container.remove(force=True)
    except Exception as exc:  # noqa: BLE001 (auto-removed containers vanish, or are mid-removal, under us)
        if not _not_found(exc) and "already in progress" not in str(exc):
            raise
    for name in collect_namespace_segments(pid_ns) if pid_ns else ():
        logger.info("removed shared memory %s left in container %s", name, container.name)


def _removed(remove: Callable[[], None], what: str) -> bool:
    """Whether ``remove()`` removed a container; failures but one gone already are warned of."""
    try:
        remove()
        return True
    except Exception as exc:  # noqa: BLE001
        if not _not_found(exc):
            logger.warning("could not remove %s: %s", what, exc)
        return False


def list_containers(client: object, labels: Mapping[str, str]) -> List[object]:
    """Containers (any state) carrying ``labels``, but one removed meanwhile."""
    found = []
    for summary in client.api.containers(all=True, filters={"label": [f"{k}={v}" for k, v in labels.items()]}):
        try:
            found.append(client.containers.get(summary["Id"]))
        except Exception as exc:  # noqa: BLE001
            if not _not_found(exc):
                raise
    return found


def agent_identity() -> AgentIdentity:
    start = process_start_time(os.getpid())
    return AgentIdentity(socket.gethostname(), os.getpid(), "0" if start is None else f"{start:.0f}")


def owner_alive(labels: Mapping[str, str]) -> bool:
    try:
        return process_alive(int(labels[LABEL_AGENT_PID]), float(labels[LABEL_AGENT_START]))
    except (KeyError, ValueError):
        return False


class DockerRuntime(Runtime):
    """``client``: a docker SDK client (tests)."""

    name = "docker"

    def __init__(self, ctx: RunContext, client: object = None) -> None:
        super().__init__(ctx)
        self.options: DockerOptions = ctx.options.of(self.name, DockerOptions)
        self._given_client = client
        self._containers: Dict[str, str] = {}  # group -> this run's container (its name until the engine gives its id)
        self._ties: Dict[str, object] = {}  # container id -> the agent's stdin attach
        self._images: Dict[str, ImageInfo] = {}
        st, python = os.stat(ctx.cwd), sys.executable
        user = choose_user(self.options.user, os.getuid(), os.getgid(), (st.st_uid, st.st_gid))
        self._host = DockerHost(ctx, agent_identity(), user, hands_over=os.getuid() == 0 and user != ROOT_USER,
                                host_python=tuple(sorted({python, os.path.abspath(python), os.path.realpath(python)})))

    @functools.cached_property
    def client(self) -> object:
        return connect(self._given_client)

    def start(self, job: WorkerStart) -> PContext:
        entrypoint, args = as_binary(job.entrypoint, job.args)
        job = replace(job, entrypoint=entrypoint, args=args)
        host = self._host_for(job.workers)  # images checked before anything is started, so a missing one fails alone

        def prepare(pc: DockerExecContext) -> Dict[int, Tuple[ExecSpec, str]]:
            return self._carry_out(docker_start(job, LogFiles(pc.stdouts, pc.stderrs, pc.error_files), host,
                                                self.options), host)

        pc = DockerExecContext(job, prepare, self.client, self.ctx.options)
        try:
            pc.start()
        except BaseException:  # (a Ctrl-C while the log tails start) the agent never sees this context
            pc.close()
            raise
        return pc

    def docker_start(self, job: WorkerStart, logs: LogFiles = LogFiles()) -> DockerStart:
        """What starting ``job`` creates and execs (``--dry-run``): reads image labels, changes nothing."""
        return docker_start(job, logs, self._host_for(job.workers), self.options)

    def _host_for(self, workers: Dict[int, LocalWorker]) -> DockerHost:
        refs = {image_for(g, members[0].device.type, self.options.images) for g, members in groups_of(workers).items()}
        return replace(self._host, run=self.ctx, images={ref: self._image(ref) for ref in sorted(refs)},
                       cgroup_parent=self._cgroup_parent, agent_env=dict(os.environ))

    def devices_seen(self, workers: Dict[int, LocalWorker]) -> Dict[int, ContainerDevices]:
        devices = {group: group_devices(group, members)[1] for group, members in groups_of(workers).items()}
        return {key: devices[w.device.group] for key, w in workers.items()}

    def exit_codes(self, pcontext: PContext) -> Dict[int, Optional[int]]:
        return pcontext.exit_codes()

    def kill_worker(self, pcontext: PContext, key: int) -> None:
        pcontext.kill(key)

    def shutdown(self) -> None:
        if not self.options.keep_containers:
            for group, ref in list(self._containers.items()):
                if _removed(lambda: remove_container(self.client.containers.get(ref)), f"group {group}'s container"):
                    logger.info("removed container of group %s", group)
        self._containers.clear()
        for tie in self._ties.values():
            with contextlib.suppress(OSError):
                tie.close()
        self._ties.clear()

    @classmethod
    def collect_stale(cls) -> List[str]:
        """Removes the run containers of this host whose agent died before it could tie them; their names.
        Kept containers are meant to outlive their run."""
        labels = {LABEL_MANAGED: "1", LABEL_KEEP: "0", LABEL_AGENT_HOST: socket.gethostname()}
        stale = [c for c in list_containers(connect(), labels) if not owner_alive(c.labels)]
        return [c.name for c in stale if _removed(functools.partial(remove_container, c), f"stale container {c.name}")]

    def _image(self, ref: str) -> ImageInfo:
        if ref not in self._images:
            import docker.errors

            try:
                image = self.client.images.get(ref)
            except docker.errors.ImageNotFound:
                raise ImageNotFoundError(
                    f"docker image {ref!r} not found on this host: build it (kaitian images build), "
                    f"pull it (docker pull {ref}) or choose another with --image VENDOR=IMAGE"
                ) from None
            labels = (image.attrs.get("Config") or {}).get("Labels") or {}
            try:
                mounts = tuple(parse_volume(s) for s in (labels.get(LABEL_HOST_MOUNTS) or "").split(",") if s)
            except DockerOptionError as exc:
                raise DockerOptionError(f"image {ref!r} has a bad {LABEL_HOST_MOUNTS} label: {exc}") from None
            self._images[ref] = ImageInfo(mounts, labels.get(LABEL_PYTHON) or "python3")
        return self._images[ref]

    @functools.cached_property
    def _cgroup_parent(self) -> Optional[str]:
        """The agent's own cgroup, where the engine can nest containers: the cgroupfs driver on cgroup v1 (the
        systemd driver wants a slice; v2 forbids child groups next to processes)."""
        try:
            info = self.client.info()
            if info.get("CgroupDriver") == "cgroupfs" and str(info.get("CgroupVersion", "1")) == "1":
                with open("/proc/self/cgroup") as f:
                    for line in f:
                        _, controllers, path = line.rstrip("\n").split(":", 2)
                        if "cpu" in controllers.split(","):
                            return path or None
        except Exception:  # noqa: BLE001 (keep the engine's default)
            pass
        return None

    def _carry_out(self, plan: DockerStart, host: DockerHost) -> Dict[int, Tuple[ExecSpec, str]]:
        """Each worker's exec and its container's id."""
        for path in plan.make_dirs:
            os.makedirs(path, exist_ok=True)
        if self.options.keep_containers and host.hands_over:
            # kept containers mount the directory of all run directories: traversable, not listable
            os.chmod(os.path.dirname(os.path.abspath(host.run.run_dir)), 0o711)
        os.makedirs(host.pid_dir, mode=0o700, exist_ok=True)
        user = host.user  # uid:gid, as from_flags and choose_user make it
        for path in plan.hand_over:  # a root agent made them owner-only: the workers' user must write there
            try:
                os.chown(path, *map(int, user.split(":")))
            except OSError as exc:
                logger.warning("could not hand %s to the container user %s: %s", path, user, exc)
        for container in plan.containers:
            self._containers[container.group] = self._ensure(container)
        return {key: (ex, self._containers[ex.group]) for key, ex in plan.execs.items()}

    def _ensure(self, spec: ContainerSpec) -> str:
        import docker.errors

        client, key = self.client, spec.lookup_labels
        found = list_containers(client, key)
        if len(found) > 1:
            raise ContainerLookupError(
                f"several kaitian containers match {key}: {', '.join(sorted(c.name for c in found))}; "
                "remove the extra ones (docker rm -f NAME) and retry"
            )
        for old in found:
            if old.labels.get(LABEL_SPEC) == spec.digest and (not spec.tied or old.id in self._ties):
                if old.status != "running":
                    old.start()
                logger.info("reusing container %s", old.name)
                return old.id
            logger.info("container %s no longer matches its group; recreating it", old.name)
            remove_container(old)
        logger.info("creating container %s (%s, user %s)", spec.name, spec.image, spec.user)
        # Shutdown removes it from here on: a Ctrl-C in the create or the start leaves nothing.
        self._containers[spec.group] = spec.name
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
        self._containers[spec.group] = container.id
        try:
            if spec.tied:  # attached before it starts (as docker run -i): stdin closes when the agent exits
                self._ties[container.id] = client.api.attach_socket(container.id, params={"stdin": 1, "stream": 1})
            container.start()
        except docker.errors.APIError as exc:
            remove_container(container)
            del self._containers[spec.group]
            self._ties.pop(container.id, None)
            why = str(exc.explanation or exc)
            hint = ""
            if 'device driver "nvidia"' in why:
                hint = ("; install the NVIDIA container toolkit and configure docker for it "
                        "(nvidia-ctk runtime configure --runtime=docker, then restart dockerd)")
            raise DockerRuntimeError(
                f"cannot start the container for group {spec.group!r} ({spec.image}): {why}{hint}"
            ) from None
        pid_ns = _pid_namespace(container)
        if pid_ns:
            record_pid_namespace(self.ctx.run_dir, pid_ns)
        return container.id
