"""Connecting to the Docker engine, finding and removing kaitian's containers, reading image labels.

The docker SDK is imported here, on first use, so ``kaitianrun`` without
``--runtime docker`` never needs it.
"""

from __future__ import annotations

import logging
import os
from typing import List, Mapping, Optional, Tuple

from kaitian.errors import ContainerLookupError, DockerOptionError, DockerUnavailableError, ImageNotFoundError
from kaitian.launcher.runtimes.docker.options import Mount, parse_volume
from kaitian.launcher.runtimes.docker.start import LABEL_HOST_MOUNTS, LABEL_PYTHON, ImageInfo

__all__ = [
    "connect", "list_containers", "find_one", "remove_container", "is_not_found", "pid_namespace_of", "image_info",
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


def is_not_found(exc: BaseException) -> bool:
    """Whether an SDK error says the container is gone already."""
    return type(exc).__name__ == "NotFound"


def pid_namespace_of(container: object) -> Optional[int]:
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

    pid_ns = pid_namespace_of(container)
    try:
        container.remove(force=True)
    except Exception as exc:  # noqa: BLE001
        # Auto-removed containers may vanish (or be mid-removal) under us.
        if not is_not_found(exc) and "already in progress" not in str(exc):
            raise
    if pid_ns:
        for name in collect_namespace_segments(pid_ns):
            logger.info("removed shared memory %s left in container %s", name, container.name)


def list_containers(client: object, labels: Mapping[str, str]) -> List[object]:
    """Containers (any state) carrying ``labels``.

    Unlike ``client.containers.list``, a container removed between the listing
    and its inspection (an auto-removed one whose agent just ended) is skipped,
    not an error.
    """
    found = []
    for summary in client.api.containers(all=True, filters={"label": [f"{k}={v}" for k, v in labels.items()]}):
        try:
            found.append(client.containers.get(summary["Id"]))
        except Exception as exc:  # noqa: BLE001
            if not is_not_found(exc):
                raise
    return found


def find_one(client: object, labels: Mapping[str, str]) -> Optional[object]:
    """The one container carrying ``labels``; ``None`` if there is none.

    Raises:
        ContainerLookupError: several containers match.
    """
    found = list_containers(client, labels)
    if len(found) > 1:
        names = ", ".join(sorted(c.name for c in found))
        raise ContainerLookupError(
            f"several kaitian containers match {dict(labels)}: {names}; "
            "remove the extra ones (docker rm -f NAME) and retry"
        )
    return found[0] if found else None


def image_info(client: object, ref: str) -> ImageInfo:
    """Reads an image's kaitian labels.

    Raises:
        ImageNotFoundError: the image is not on this host.
        DockerOptionError: its host-mounts label cannot be parsed.
    """
    import docker.errors

    try:
        image = client.images.get(ref)
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
    return ImageInfo(mounts, labels.get(LABEL_PYTHON) or "python3")
