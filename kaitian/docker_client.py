"""The Docker engine client that ``kaitian images`` and the docker runtime share.

The docker SDK is imported on first use, so kaitian without Docker never needs it.
"""

from __future__ import annotations

import os

from kaitian.errors import DockerUnavailableError

__all__ = ["connect"]

_env_client: object = None


def connect(client: object = None) -> object:
    """A docker SDK client that answered a ping: ``client`` (tests), else the environment's (``DOCKER_HOST``),
    made once: the agent, its stale collection and its runtime share it."""
    global _env_client
    if client is None and _env_client is not None:
        return _env_client
    try:
        import docker
        import docker.errors
    except ImportError:
        raise DockerUnavailableError("the docker runtime needs the docker SDK: pip install 'docker>=7'") from None
    import requests.exceptions

    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        pinged = docker.DockerClient.from_env(max_pool_size=64) if client is None else client
        pinged.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
        if any(isinstance(e, PermissionError) for e in (exc, exc.__context__)) or "Permission denied" in str(exc):
            raise DockerUnavailableError(
                f"no permission on the Docker socket ({where}): add your user to the 'docker' group "
                "(sudo usermod -aG docker $USER, then log in again) or run as root"
            ) from None
        raise DockerUnavailableError(
            f"cannot reach the Docker daemon at {where}: start it "
            "(sudo systemctl start docker, or bash scripts/docker-engine.sh) and retry"
        ) from None
    if client is None:
        _env_client = pinged
    return pinged
