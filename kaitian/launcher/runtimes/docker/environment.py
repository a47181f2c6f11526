"""A worker's environment as it must look inside its container.

Workers inherit the agent's environment (as torch's local subprocesses do)
minus what describes the host's software rather than the job: the image has
its own ``PATH``, libraries and Python.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

from kaitian.devices.device import ContainerDevices, WorkerDevice
from kaitian.devices.vendors import VENDORS
from kaitian.devices.visible import VISIBLE_INDICES_ENV, parse_visible

__all__ = ["HOST_ONLY_ENV", "worker_env"]

# Host variables that describe the host's software, not the job.
HOST_ONLY_ENV = frozenset(
    {
        "PATH", "HOME", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM",
        "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHOME", "PYTHONEXECUTABLE",
        "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_EXE",
        "CONDA_PYTHON_EXE", "CONDA_SHLVL", "PYENV_VERSION", "PYENV_DIR",
        "PYENV_ROOT", "PYENV_HOOK_PATH", "PYENV_SHELL",
    }
)

# Where a worker without a writable home keeps caches (the container's tmpfs).
CONTAINER_HOME = "/tmp"


def worker_env(
    env: Mapping[str, str],
    *,
    vendor: str,
    devices: ContainerDevices,
    device: Optional[WorkerDevice],
    mounted: Sequence[str],
) -> Dict[str, str]:
    """The worker's environment inside the container.

    Host-software variables (``PATH``, ``LD_LIBRARY_PATH``, ``PYTHONHOME`` …)
    are left to the image; ``HOME`` is the container's tmpfs; ``TMPDIR`` is
    kept only if it is mounted. The container's view of its devices (the
    vendor's visibility variable, ``KAITIAN_VISIBLE_INDICES``: see
    :func:`kaitian.devices.container.container_devices`) replaces the host's;
    ``KAITIAN_DEVICE_INDEX`` stays the physical index. A worker the agent
    limited to its own device (``--virtual-local-rank``) keeps seeing only
    that one, as the container numbers it. Everything else torchrun and
    kaitianrun set passes through unchanged.

    Args:
        env: the worker's environment as the agent built it.
        vendor: the container's device type.
        devices: the container's devices.
        device: the worker's device.
        mounted: container paths that are bind mounts of host directories.
    """
    out = {k: v for k, v in env.items() if k not in HOST_ONLY_ENV}
    out["HOME"] = CONTAINER_HOME
    tmp = out.get("TMPDIR")
    if tmp and not any(tmp == m or tmp.startswith(m.rstrip("/") + "/") for m in mounted):
        del out["TMPDIR"]
    view = dict(devices.env)
    visible = VENDORS[vendor].visible_env if vendor in VENDORS else None
    if visible and visible in view and device is not None and device.index in devices.index_map:
        own_only = len(parse_visible(env.get(visible) or "")) == 1 and len(devices.index_map) > 1
        if own_only:
            view[visible] = parse_visible(view[visible])[devices.index_map[device.index]]
            view[VISIBLE_INDICES_ENV] = str(device.index)
    out.update(view)
    return out
