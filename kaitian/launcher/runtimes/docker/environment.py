"""A worker's environment as it must look inside its container.

Workers inherit the agent's environment (as torch's local subprocesses do)
minus what describes the host's software rather than the job: the image has
its own ``PATH``, libraries and Python.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

from kaitian.launcher.runtimes.docker.paths import inside

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


def worker_env(env: Mapping[str, str], *, mounted: Sequence[str]) -> Dict[str, str]:
    """The worker's environment inside the container.

    Host-software variables (``PATH``, ``LD_LIBRARY_PATH``, ``PYTHONHOME`` …)
    are left to the image; ``HOME`` is the container's tmpfs; ``TMPDIR`` is
    kept only if it is mounted. Everything else torchrun and kaitianrun set
    (the container's view of its devices included) passes through unchanged.

    Args:
        env: the worker's environment as the agent and the runtime built it.
        mounted: container paths that are bind mounts of host directories.
    """
    out = {k: v for k, v in env.items() if k not in HOST_ONLY_ENV}
    out["HOME"] = CONTAINER_HOME
    tmp = out.get("TMPDIR")
    if tmp and not any(inside(tmp, m) for m in mounted):
        del out["TMPDIR"]
    return out
