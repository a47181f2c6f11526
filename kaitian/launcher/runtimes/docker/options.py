"""The docker runtime's options, checked once from the command line.

``kaitianrun`` builds one :class:`DockerOptions` from its flags
(``DockerOptions.from_flags``) before anything starts, so a bad value is a
one-line error and the runtime reads typed fields, never a dict.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, Mapping, Optional, Tuple

from kaitian.errors import DockerOptionError

__all__ = ["Mount", "DockerOptions", "parse_volume", "parse_images", "parse_user", "ROOT_USER"]

# --container-user root: the only way to run workers as root in a container.
ROOT_USER = "0:0"

_SHM_SIZE = re.compile(r"^\d+(\.\d+)?[bkmgBKMG]?$")
_USER = re.compile(r"^\d+(:\d+)?$")


@dataclass(frozen=True)
class Mount:
    """A bind mount ``source`` (host) -> ``target`` (container)."""

    source: str
    target: str
    read_only: bool = False

    def to_docker(self) -> Dict[str, object]:
        """The Engine API's ``Mount`` (what ``docker.types.Mount`` builds).

        The Engine's key names, not the SDK's keyword names: it matches keys
        without regard to case but not ``read_only`` to ``ReadOnly``.
        """
        return {"Type": "bind", "Source": self.source, "Target": self.target, "ReadOnly": self.read_only}


def parse_volume(spec: str) -> Mount:
    """Parses ``-v HOST:CONTAINER[:ro|rw]`` (``HOST`` alone mounts it at the same path).

    Raises:
        DockerOptionError: malformed spec or a relative container path.
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


def parse_images(values: Iterable[str]) -> Dict[str, str]:
    """``--image VENDOR_OR_GROUP=IMAGE`` values as a dict.

    Raises:
        DockerOptionError: a value without ``=`` or with an empty side.
    """
    images: Dict[str, str] = {}
    for value in values:
        key, sep, ref = value.partition("=")
        if not sep or not key or not ref:
            raise DockerOptionError(
                f"--image {value!r}: expected VENDOR_OR_GROUP=IMAGE[:TAG], e.g. cuda=kaitian:cuda"
            )
        images[key] = ref
    return images


def parse_user(value: Optional[str]) -> Optional[str]:
    """``--container-user``: ``root``, ``UID`` or ``UID:GID`` as ``uid:gid`` (``None``: the default).

    Raises:
        DockerOptionError: anything else (user names would need the image's passwd).
    """
    if value is None or value == "":
        return None
    if value == "root":
        return ROOT_USER
    if not _USER.match(value):
        raise DockerOptionError(f"--container-user {value!r}: expected root, UID or UID:GID")
    uid, _, gid = value.partition(":")
    return f"{int(uid)}:{int(gid or uid)}"


@dataclass(frozen=True)
class DockerOptions:
    """What the docker runtime was asked for on the command line.

    Attributes:
        images: image per group or vendor name (``--image cuda=repo:tag``).
        keep_containers: leave containers running after the run for reuse.
        volumes: extra bind mounts (``-v host:container[:ro]``).
        shm_size: size of the containers' ``/dev/shm`` (``--shm-size``).
        user: ``uid:gid`` the workers run as (``--container-user``); ``None``
            picks a non-root user (see ``DockerRuntime.worker_user``).
    """

    images: Mapping[str, str] = field(default_factory=dict)
    keep_containers: bool = False
    volumes: Tuple[Mount, ...] = ()
    shm_size: str = "2g"
    user: Optional[str] = None

    def __post_init__(self) -> None:
        for key, ref in self.images.items():
            if not key or not ref:
                raise DockerOptionError(f"--image {key}={ref}: expected VENDOR_OR_GROUP=IMAGE[:TAG]")
        if not _SHM_SIZE.match(self.shm_size):
            raise DockerOptionError(f"--shm-size {self.shm_size!r}: expected a size such as 2g or 512m")

    @classmethod
    def from_flags(
        cls,
        *,
        images: Iterable[str] = (),
        keep_containers: bool = False,
        volumes: Iterable[str] = (),
        shm_size: str = "2g",
        container_user: Optional[str] = None,
    ) -> "DockerOptions":
        """Checks kaitianrun's docker flags (``--image``, ``-v`` … as given).

        Raises:
            DockerOptionError: a value that cannot be used.
        """
        return cls(
            images=parse_images(images),
            keep_containers=keep_containers,
            volumes=tuple(parse_volume(v) for v in volumes),
            shm_size=shm_size or "2g",
            user=parse_user(container_user),
        )

    @classmethod
    def from_args(cls, args: object, config: object) -> "DockerOptions":
        """The docker options from kaitianrun's parsed flags (checked: ``from_flags``)."""
        return cls.from_flags(
            images=args.image,
            keep_containers=args.keep_containers,
            volumes=args.volume,
            shm_size=args.shm_size,
            container_user=args.container_user,
        )
