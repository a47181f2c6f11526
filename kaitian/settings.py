"""Every ``KAITIAN_*`` setting, read in one place.

Workers get most of these from ``kaitianrun``; a plain ``torchrun`` user may set
them by hand. Add a field here (with its variable and default) rather than
reading ``os.environ`` anywhere else.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional
from kaitian.errors import SettingError

__all__ = ["Settings", "settings", "SettingError"]


def _int(env: Mapping[str, str], name: str, default: Optional[int]) -> Optional[int]:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not an integer") from None


def _float(env: Mapping[str, str], name: str, default: Optional[float]) -> Optional[float]:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not a number") from None


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name, "") or default
    if raw not in choices:
        raise SettingError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


@dataclass(frozen=True)
class Settings:
    """A snapshot of the ``KAITIAN_*`` environment.

    Attributes:
        device_type: ``KAITIAN_DEVICE_TYPE`` - this rank's vendor device type
            (``cuda``, ``mlu``, ``cpu``); ``None`` means infer it.
        device_index: ``KAITIAN_DEVICE_INDEX`` - this rank's device: its physical
            index on the host (CPU: slot index), not torch's ordinal (see
            :mod:`kaitian.devices.visible`, which also reads
            ``KAITIAN_VISIBLE_INDICES``, set in containers).
        device_uuid: ``KAITIAN_DEVICE_UUID`` - the device's UUID, when known.
        group: ``KAITIAN_GROUP`` - explicit group name; defaults to the device type.
        run_dir: ``KAITIAN_RUN_DIR`` - directory shared by the job's ranks on one
            host (file store, shared-memory names); ``None`` means a private temp dir.
        capability: ``KAITIAN_CAPABILITY`` - this rank's measured throughput
            (samples/s on the standard workload); ``None`` when unknown.
        bridge: ``KAITIAN_BRIDGE`` - inter-group transport: ``auto`` (shared memory
            on one host, TCP across hosts), ``shm`` or ``tcp`` (forces TCP on one host).
        intra: ``KAITIAN_INTRA`` - intra-group path for CPU groups: ``auto``,
            ``gloo`` (the vendor library) or ``shm`` (kaitian's shared memory).
        chunk_bytes: ``KAITIAN_CHUNK_BYTES`` - pipeline chunk size for large tensors.
        config_path: ``KAITIAN_CONFIG`` - the TOML file written by ``kaitian init``.
        monitor_dir: ``KAITIAN_MONITOR_DIR`` - where ranks write monitor samples
            (set by ``kaitianrun --monitor``).
        cpu_quota_mode: ``KAITIAN_CPU_QUOTA_MODE`` - how the local runtime enforces
            ``--cpu-quota``: ``auto`` (cgroup v1 cpu controller when writable,
            else a SIGSTOP/SIGCONT duty cycle), ``cgroup`` or ``signal``.
        bridge_addr: ``KAITIAN_BRIDGE_ADDR`` - IPv4 address this rank's TCP bridge
            listens on and advertises; ``None`` means derive it (the interface
            that routes to ``MASTER_ADDR``).
        spin_us: ``KAITIAN_SPIN_US`` - microseconds the shared-memory bridge spins
            waiting for a peer before it sleeps on a futex.
    """

    device_type: Optional[str] = None
    device_index: Optional[int] = None
    device_uuid: Optional[str] = None
    group: Optional[str] = None
    run_dir: Optional[str] = None
    capability: Optional[float] = None
    bridge: str = "auto"
    intra: str = "auto"
    chunk_bytes: int = 1 << 20
    config_path: str = ""
    monitor_dir: Optional[str] = None
    cpu_quota_mode: str = "auto"
    bridge_addr: Optional[str] = None
    spin_us: int = 50

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Settings":
        """Reads the settings from ``env`` (default: ``os.environ``).

        Raises:
            SettingError: a variable is set to a value that cannot be used.
        """
        env = os.environ if env is None else env
        return cls(
            device_type=env.get("KAITIAN_DEVICE_TYPE") or None,
            device_index=_int(env, "KAITIAN_DEVICE_INDEX", None),
            device_uuid=env.get("KAITIAN_DEVICE_UUID") or None,
            group=env.get("KAITIAN_GROUP") or None,
            run_dir=env.get("KAITIAN_RUN_DIR") or None,
            capability=_float(env, "KAITIAN_CAPABILITY", None),
            bridge=_choice(env, "KAITIAN_BRIDGE", "auto", ("auto", "shm", "tcp")),
            intra=_choice(env, "KAITIAN_INTRA", "auto", ("auto", "gloo", "shm")),
            chunk_bytes=_int(env, "KAITIAN_CHUNK_BYTES", 1 << 20),
            config_path=env.get("KAITIAN_CONFIG") or default_config_path(env),
            monitor_dir=env.get("KAITIAN_MONITOR_DIR") or None,
            cpu_quota_mode=_choice(
                env, "KAITIAN_CPU_QUOTA_MODE", "auto", ("auto", "cgroup", "signal")
            ),
            bridge_addr=env.get("KAITIAN_BRIDGE_ADDR") or None,
            spin_us=_int(env, "KAITIAN_SPIN_US", 50),
        )


def default_config_path(env: Mapping[str, str]) -> str:
    """``$XDG_CONFIG_HOME/kaitian/config.toml`` (``~/.config`` by default)."""
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "kaitian", "config.toml")


def private_tmp_dir(prefix: str = "kaitian-") -> str:
    """An owner-only temp directory (used when no run directory is given)."""
    return tempfile.mkdtemp(prefix=prefix)


def settings() -> Settings:
    """The current process's settings (read fresh each call; cheap)."""
    return Settings.from_env()
