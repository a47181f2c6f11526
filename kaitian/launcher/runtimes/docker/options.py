"""The docker runtime's flags, checked once before anything starts (a bad value is a one-line error)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, Mapping, Optional, Tuple

from kaitian.errors import DockerOptionError

__all__ = ["Mount", "DockerOptions", "parse_volume", "ROOT_USER", "DEFAULT_SHM_SIZE"]

ROOT_USER = "0:0"  # only with --container-user root do workers run as root in a container
DEFAULT_SHM_SIZE = "2g"

_SHM_SIZE = re.compile(r"^\d+(\.\d+)?[bkmgBKMG]?$")
_USER = re.compile(r"^\d+(:\d+)?$")


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False

    def to_docker(self) -> Dict[str, object]:
        # the Engine ignores key case, but would not match read_only to ReadOnly
        return {"Type": "bind", "Source": self.source, "Target": self.target, "ReadOnly": self.read_only}


def parse_volume(spec: str) -> Mount:
    """``-v HOST[:CONTAINER[:ro|rw]]`` (``HOST`` alone mounts it at the same path)."""
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3:
        raise DockerOptionError(f"--volume {spec!r}: expected HOST_PATH[:CONTAINER_PATH[:ro|rw]]")
    target = parts[1] if len(parts) > 1 and parts[1] else parts[0]
    mode = parts[2] if len(parts) > 2 else "rw"
    if mode not in ("ro", "rw"):
        raise DockerOptionError(f"--volume {spec!r}: mode must be 'ro' or 'rw', not {mode!r}")
    if not os.path.isabs(target):
        raise DockerOptionError(f"--volume {spec!r}: the container path must be absolute")
    return Mount(os.path.abspath(os.path.expanduser(parts[0])), target, mode == "ro")


@dataclass(frozen=True)
class DockerOptions:
    """``user``: ``--container-user`` as ``uid:gid`` (``None``: the runtime chooses, ``start.choose_user``)."""

    images: Mapping[str, str] = field(default_factory=dict)
    keep_containers: bool = False
    volumes: Tuple[Mount, ...] = ()
    shm_size: str = DEFAULT_SHM_SIZE
    user: Optional[str] = None

    @classmethod
    def from_flags(cls, *, images: Iterable[str] = (), keep_containers: bool = False, volumes: Iterable[str] = (),
                   shm_size: str = DEFAULT_SHM_SIZE, container_user: Optional[str] = None) -> "DockerOptions":
        by_name: Dict[str, str] = {}
        for value in images:
            key, _, ref = value.partition("=")
            if not key or not ref:
                raise DockerOptionError(
                    f"--image {value!r}: expected VENDOR_OR_GROUP=IMAGE[:TAG], e.g. cuda=kaitian:cuda"
                )
            by_name[key] = ref
        mounts = tuple(parse_volume(v) for v in volumes)
        user = container_user or None
        if user == "root":
            user = ROOT_USER
        elif user:
            if not _USER.match(user):
                raise DockerOptionError(f"--container-user {user!r}: expected root, UID or UID:GID")
            uid, _, gid = user.partition(":")
            user = f"{int(uid)}:{int(gid or uid)}"
        shm_size = shm_size or DEFAULT_SHM_SIZE
        if not _SHM_SIZE.match(shm_size):
            raise DockerOptionError(f"--shm-size {shm_size!r}: expected a size such as 2g or 512m")
        return cls(by_name, keep_containers, mounts, shm_size, user)

    @classmethod
    def from_args(cls, args: object, config: object) -> "DockerOptions":
        return cls.from_flags(images=args.image, keep_containers=args.keep_containers, volumes=args.volume,
                              shm_size=args.shm_size, container_user=args.container_user)
