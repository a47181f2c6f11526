"""``kaitian images build``: build the per-vendor container images.

Targets are the Dockerfiles in ``dockerfiles/``:

- ``cuda``, ``mlu``, ``cpu``: real images (vendor PyTorch base + kaitian built
  from this checkout); they need the base image from a registry.
- ``cpu-host``: a skeleton image that runs the *host's* Python environment,
  bind-mounted at run time. It needs no registry, so CI and air-gapped hosts
  can run ``--runtime docker``; it only works on the host that built it.

Build output is streamed as it comes (docker's step lines, pip's output).
"""

from __future__ import annotations

import io
import os
import shutil
import site
import sys
import tarfile
import tempfile
import time
from typing import Dict, Iterable, List, Optional, TextIO

from kaitian.devices.vendors import VENDORS
from kaitian.launcher.runtimes.docker.start import outermost
from kaitian.errors import ImageBuildError

__all__ = ["build", "TARGETS", "ImageBuildError", "host_mounts", "host_python", "host_python_env", "build_context"]

TARGETS = ("cpu-host", "cpu", "cuda", "mlu")

# kaitian/images.py -> the checkout root, one level up.
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
_DOCKERFILES = os.path.join(_REPO, "dockerfiles")
# What the real images need from the checkout: sources and build files only.
_CONTEXT_ITEMS = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE", "kaitian", "cpp")
_SKIP_SUFFIXES = (".so", ".pyc", ".o")
_SKIP_DIRS = {"__pycache__", "build", ".git", "dist", ".pytest_cache"}
# /etc files the host Python and its libraries read (user names, linker cache, name service).
_HOST_ETC = ("passwd", "group", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "localtime", "ssl")


def default_tag(target: str) -> str:
    """``kaitian:cpu`` for ``cpu`` and ``cpu-host`` (both serve CPU groups), ``kaitian:<vendor>`` otherwise."""
    vendor = "cpu" if target == "cpu-host" else target
    return VENDORS[vendor].image


def host_python() -> str:
    """The interpreter the ``cpu-host`` image runs: this one, as invoked.

    Not its real path: a virtualenv's ``bin/python`` is a link to the base
    interpreter, and only when started through the link does Python find the
    venv's ``pyvenv.cfg`` (and so its site-packages). A conda env's python
    is a real file inside the env, so both cases are ``sys.executable``.
    """
    return os.path.abspath(sys.executable)


def host_python_env() -> Dict[str, str]:
    """What activating this interpreter's environment sets, for the ``cpu-host`` image.

    ``VIRTUAL_ENV`` for a virtualenv, ``CONDA_PREFIX`` for a conda env (a
    prefix with ``conda-meta/``); read from the interpreter, not from the
    shell, whose variables may name another environment. The host's own
    values are dropped at ``docker exec`` like all host-software variables.
    """
    if sys.prefix != sys.base_prefix:
        return {"VIRTUAL_ENV": sys.prefix}
    if os.path.isdir(os.path.join(sys.prefix, "conda-meta")):
        return {"CONDA_PREFIX": sys.prefix}
    return {}


def host_mounts() -> List[str]:
    """Host paths the ``cpu-host`` image needs, as ``HOST:CONTAINER:ro`` (same path).

    ``/usr`` (system libraries and tools); the environment's prefix
    (``sys.prefix``: the venv or conda env) and the interpreter's own
    (``sys.base_prefix`` and where the real executable lives); the user site
    directory; the directory kaitian is imported from (an editable checkout);
    and the targets of links on the path to the interpreter.
    """
    paths = ["/usr"]
    real = os.path.realpath(sys.executable)
    for prefix in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.dirname(real))):
        paths.append(os.path.realpath(prefix))
        if os.path.abspath(prefix) != os.path.realpath(prefix):
            paths.append(os.path.abspath(prefix))  # the link's own path, as the venv names it
    user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user_site and os.path.isdir(user_site):
        paths.append(user_site)
    import kaitian

    paths.append(os.path.dirname(os.path.dirname(os.path.abspath(kaitian.__file__))))
    # Drop paths inside another listed path.
    kept = outermost(paths)
    for p in kept:
        if "," in p or " " in p:
            raise ImageBuildError(f"cannot mount {p!r} into the cpu-host image: commas and spaces are not supported")
    return [f"{p}:{p}:ro" for p in sorted(kept)]


def _host_rootfs(root: str) -> None:
    """A skeleton root file system for ``cpu-host`` under ``root``."""
    for d in ("usr", "etc", "proc", "sys", "dev", "run", "root", "home", "var/tmp", "sbin"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.makedirs(os.path.join(root, "tmp"), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    # Merged /usr: /bin and /lib point into the mounted /usr. /sbin stays a real
    # directory because the engine mounts its init (docker-init) at /sbin.
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        if os.path.isdir(os.path.join("/", target)):
            os.symlink(target, os.path.join(root, link))
    for name in _HOST_ETC:
        src = os.path.join("/etc", name)
        dst = os.path.join(root, "etc", name)
        if os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True)
        elif os.path.exists(src):
            shutil.copy2(src, dst)


def _add_tree(tar: tarfile.TarFile, path: str, arcname: str) -> None:
    def keep(info: tarfile.TarInfo) -> Optional[tarfile.TarInfo]:
        base = os.path.basename(info.name)
        if base in _SKIP_DIRS or base.endswith(_SKIP_SUFFIXES) or base.endswith(".egg-info"):
            return None
        return info

    tar.add(path, arcname=arcname, filter=keep)


def build_context(target: str, workdir: str) -> bytes:
    """The build context of ``target`` as a tar archive (Dockerfile included).

    Raises:
        ImageBuildError: the target's Dockerfile is missing.
    """
    dockerfile = os.path.join(_DOCKERFILES, f"{target}.Dockerfile")
    if not os.path.isfile(dockerfile):
        raise ImageBuildError(f"no Dockerfile for {target!r} at {dockerfile}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(dockerfile, arcname="Dockerfile")
        if target == "cpu-host":
            rootfs = os.path.join(workdir, "rootfs")
            _host_rootfs(rootfs)
            tar.add(rootfs, arcname="rootfs")
        else:
            for item in _CONTEXT_ITEMS:
                path = os.path.join(_REPO, item)
                if os.path.exists(path):
                    _add_tree(tar, path, item)
    return buf.getvalue()


def _build_args(target: str, base: Optional[str]) -> Dict[str, str]:
    args: Dict[str, str] = {}
    if base:
        args["BASE"] = base
    if target == "cpu-host":
        python = host_python()
        args["HOST_MOUNTS"] = ",".join(host_mounts())
        args["PYTHON"] = python
        args["PATH_DIRS"] = f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin"
        args.update(host_python_env())
    return args


def build(
    target: str,
    *,
    tag: Optional[str] = None,
    base: Optional[str] = None,
    no_cache: bool = False,
    out: Optional[TextIO] = None,
    client: object = None,
) -> str:
    """Builds one image, streaming docker's progress to ``out``.

    Args:
        target: one of ``TARGETS``.
        tag: image name (default: the vendor table's, ``kaitian:<vendor>``).
        base: override the Dockerfile's ``BASE`` image.
        no_cache: build without docker's layer cache.
        out: where progress goes (default: stdout).
        client: docker SDK client (tests); built from the environment if ``None``.

    Returns:
        The image tag.

    Raises:
        ImageBuildError: the build failed (message carries docker's error).
        DockerUnavailableError: the daemon cannot be reached.
    """
    from kaitian.docker_client import connect

    if target not in TARGETS:
        raise ImageBuildError(f"unknown image {target!r}; choose from: {', '.join(TARGETS)}")
    tag = tag or default_tag(target)
    out = out or sys.stdout
    client = connect(client)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kaitian-image-") as workdir:
        context = build_context(target, workdir)
        out.write(f"[images] building {tag} from dockerfiles/{target}.Dockerfile "
                  f"(context {len(context) / 1e6:.1f} MB)\n")
        out.flush()
        stream = client.api.build(
            fileobj=io.BytesIO(context),
            custom_context=True,
            tag=tag,
            buildargs=_build_args(target, base),
            rm=True,
            forcerm=True,
            nocache=no_cache,
            decode=True,
        )
        _follow(stream, out, target)
    out.write(f"[images] built {tag} in {time.monotonic() - started:.1f}s\n")
    out.flush()
    return tag


def _follow(stream: Iterable[dict], out: TextIO, target: str) -> None:
    """Prints docker's build stream; raises on its error record."""
    last_status = ""
    for chunk in stream:
        if "error" in chunk:
            message = str(chunk.get("error", "")).strip()
            hint = ""
            if "pull access denied" in message or "lookup" in message or "dial tcp" in message \
                    or "not found" in message or "manifest" in message:
                hint = (" (the base image cannot be pulled: pull or load it first, pass --base, "
                        "or use the cpu-host image on hosts without a registry)")
            raise ImageBuildError(f"building {target} failed: {message}{hint}")
        if "stream" in chunk:
            out.write(chunk["stream"])
        elif "status" in chunk:
            line = f"{chunk.get('id', '')} {chunk['status']} {chunk.get('progress', '')}".strip()
            if line != last_status:
                out.write(line + "\n")
                last_status = line
        out.flush()
