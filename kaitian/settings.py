"""Every ``KAITIAN_*`` setting, read and written in one place.

Workers get most of these from ``kaitianrun``; a plain ``torchrun`` user may set
them by hand. Each field of :class:`Settings` names its variable, how it is
read and how it is written: :meth:`Settings.from_env` is the one reader,
:meth:`Settings.to_env` the one writer of a worker's ``KAITIAN_*`` environment
(kaitianrun's agent, the docker runtime, the tests' rank runner and the
benchmarks write through it). Add a field here rather than reading or writing
``os.environ`` anywhere else.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Mapping, Optional

from kaitian.devices.device import WorkerDevice
from kaitian.errors import SettingError

__all__ = ["Settings", "settings", "fake_accelerator", "SettingError"]


# The ranges of the numeric settings (documented in docs/backend.md).
CHUNK_BYTES_RANGE = (4096, 256 << 20)  # a shm segment holds about 9 chunks
SPIN_US_RANGE = (0, 100_000)  # spinning past 0.1 s only burns a core
DEVICE_INDEX_RANGE = (0, 65535)
FAKE_DEVICES_RANGE = (1, 64)  # the fake accelerator's device limit


def _int(env: Mapping[str, str], name: str, default: Optional[int],
         bounds: tuple[int, int]) -> Optional[int]:
    raw = env.get(name, "")
    if raw == "":
        return default
    lo, hi = bounds
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise SettingError(f"{name}={raw!r}: expected an integer from {lo} to {hi}")
    return value


def _positive(env: Mapping[str, str], name: str, default: Optional[float]) -> Optional[float]:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise SettingError(f"{name}={raw!r}: expected a finite number above 0")
    return value


def _port_range(env: Mapping[str, str], name: str) -> Optional[tuple[int, int]]:
    raw = env.get(name, "")
    if raw == "":
        return None
    lo, sep, hi = raw.partition("-")
    try:
        ports = (int(lo), int(hi))
    except ValueError:
        ports = (0, 0)
    if not sep or not 1 <= ports[0] <= ports[1] <= 65535:
        raise SettingError(
            f"{name}={raw!r}: expected LO-HI, two port numbers with 1 <= LO <= HI <= 65535 "
            "(e.g. 29600-29699)"
        )
    return ports


def _secret(env: Mapping[str, str], name: str) -> Optional[str]:
    raw = env.get(name, "")
    if raw == "":
        return None
    if len(raw) < 16:
        raise SettingError(
            f"{name} is too short ({len(raw)} characters); use at least 16 random characters, "
            "e.g. python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return raw


def fake_accelerator(env: Optional[Mapping[str, str]] = None) -> Optional[tuple[str, int]]:
    """``KAITIAN_FAKE_ACCELERATOR=mlu:N`` as ``("mlu", N)``; ``None`` when unset.

    Read on its own by ``import kaitian``, which installs the fake devices
    before anything else reads the settings.

    Raises:
        SettingError: the value is not ``mlu:N`` with N in range.
    """
    env = os.environ if env is None else env
    name = "KAITIAN_FAKE_ACCELERATOR"
    raw = env.get(name, "")
    if raw == "":
        return None
    kind, _, count = raw.partition(":")
    lo, hi = FAKE_DEVICES_RANGE
    if kind != "mlu" or not count.isdigit() or not lo <= int(count) <= hi:
        raise SettingError(f"{name}={raw!r}: expected mlu:N with N from {lo} to {hi} (e.g. mlu:2)")
    return kind, int(count)


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name, "") or default
    if raw not in choices:
        raise SettingError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def _indices(env: Mapping[str, str], name: str) -> Optional[tuple[int, ...]]:
    raw = env.get(name, "")
    if raw == "":
        return None
    items = [item.strip() for item in raw.split(",")]
    if not all(item.isdigit() for item in items):
        raise SettingError(f"{name}={raw!r}: expected device indices such as 1,3")
    return tuple(int(item) for item in items)


def _text(env: Mapping[str, str], name: str) -> Optional[str]:
    return env.get(name) or None


def _var(name: str, read: Callable[[Mapping[str, str], str], Any], default: Any = None,
         write: Callable[[Any], str] = str, **kw: Any) -> Any:
    """A settings field: its variable, its reader ``read(env, name)`` and its writer ``write(value)``."""
    return field(default=default, metadata={"env": name, "read": read, "write": write}, **kw)


def _one_of(*choices: str) -> Callable[[Mapping[str, str], str], str]:
    """A reader of one of ``choices`` (the first is the default)."""
    return lambda env, name: _choice(env, name, choices[0], choices)


def _ranged(default: Optional[int], bounds: tuple[int, int]) -> Callable[[Mapping[str, str], str], Optional[int]]:
    return lambda env, name: _int(env, name, default, bounds)


@dataclass(frozen=True)
class Settings:
    """A snapshot of the ``KAITIAN_*`` environment.

    Attributes:
        device_type: ``KAITIAN_DEVICE_TYPE`` - this rank's vendor device type
            (``cuda``, ``mlu``, ``cpu``); ``None`` means infer it.
        device_index: ``KAITIAN_DEVICE_INDEX`` - this rank's device: its physical
            index on the host (CPU: slot index), not torch's ordinal (see
            :mod:`kaitian.devices.visible`).
        device_uuid: ``KAITIAN_DEVICE_UUID`` - the device's UUID, when known.
        visible_indices: ``KAITIAN_VISIBLE_INDICES`` - set in containers: the
            physical indices of the devices the container holds, in the order
            torch numbers them, so a worker turns its physical index into its
            ordinal (its visibility variable may hold UUIDs or renumbered indices).
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
        job_key: ``KAITIAN_JOB_KEY`` - the secret TCP bridge peers prove they hold
            (set by the user or scheduler, or generated by ``kaitianrun``); never
            written to any store. ``None``: a key made per group and shared
            through the group's store.
        bridge_ports: ``KAITIAN_BRIDGE_PORTS`` - ``(lo, hi)``: the TCP bridge listens
            on the first free port of that range; ``None`` means any port.
        agent_version: ``KAITIAN_AGENT_VERSION`` - ``<kaitian version>/<bridge
            protocol>`` of the kaitianrun that started this worker; a worker
            whose own kaitian differs (another image) refuses to start.
        fake_accelerator: ``KAITIAN_FAKE_ACCELERATOR`` - ``mlu:N`` as
            ``("mlu", N)``, N from 1 to 64: N fake MLUs
            (:mod:`kaitian.testing.fake_accelerator`) stand in for ``torch_mlu``
            in every process that imports kaitian, and device discovery lists
            them; ignored where a real ``torch_mlu`` is installed.
        elastic_id: ``KAITIAN_ELASTIC_ID`` - this worker's member id under
            ``kaitianrun --on-failure continue`` (``<node>/<local rank>/<incarnation>``);
            ``None``: a lost worker stops the job (:mod:`kaitian.elastic` raises the loss).
        elastic_join: ``KAITIAN_ELASTIC_JOIN`` - ``1``: this worker joins a running
            job (a restarted worker) and receives the training state from a member.
        elastic_run: ``KAITIAN_ELASTIC_RUN`` - the start of the worker group whose
            store keys this worker uses (``kaitian/elastic/<run>/``).
        elastic_min_nodes: ``KAITIAN_ELASTIC_MIN_NODES`` - ``--nnodes`` MIN: fewer
            nodes left cannot go on.
    """

    device_type: Optional[str] = _var("KAITIAN_DEVICE_TYPE", _text)
    device_index: Optional[int] = _var("KAITIAN_DEVICE_INDEX", _ranged(None, DEVICE_INDEX_RANGE))
    device_uuid: Optional[str] = _var("KAITIAN_DEVICE_UUID", _text)
    visible_indices: Optional[tuple[int, ...]] = _var(
        "KAITIAN_VISIBLE_INDICES", _indices, write=lambda v: ",".join(map(str, v)))
    group: Optional[str] = _var("KAITIAN_GROUP", _text)
    run_dir: Optional[str] = _var("KAITIAN_RUN_DIR", _text)
    capability: Optional[float] = _var("KAITIAN_CAPABILITY", lambda env, name: _positive(env, name, None))
    bridge: str = _var("KAITIAN_BRIDGE", _one_of("auto", "shm", "tcp"), "auto")
    intra: str = _var("KAITIAN_INTRA", _one_of("auto", "gloo", "shm"), "auto")
    chunk_bytes: int = _var("KAITIAN_CHUNK_BYTES", _ranged(1 << 20, CHUNK_BYTES_RANGE), 1 << 20)
    config_path: str = _var("KAITIAN_CONFIG", lambda env, name: env.get(name) or default_config_path(env), "")
    monitor_dir: Optional[str] = _var("KAITIAN_MONITOR_DIR", _text)
    cpu_quota_mode: str = _var("KAITIAN_CPU_QUOTA_MODE", _one_of("auto", "cgroup", "signal"), "auto")
    bridge_addr: Optional[str] = _var("KAITIAN_BRIDGE_ADDR", _text)
    spin_us: int = _var("KAITIAN_SPIN_US", _ranged(50, SPIN_US_RANGE), 50)
    job_key: Optional[str] = _var("KAITIAN_JOB_KEY", _secret, repr=False)
    bridge_ports: Optional[tuple[int, int]] = _var(
        "KAITIAN_BRIDGE_PORTS", _port_range, write=lambda ports: f"{ports[0]}-{ports[1]}")
    agent_version: Optional[str] = _var("KAITIAN_AGENT_VERSION", _text)
    fake_accelerator: Optional[tuple[str, int]] = _var(
        "KAITIAN_FAKE_ACCELERATOR", lambda env, name: fake_accelerator(env), write=lambda fake: f"{fake[0]}:{fake[1]}")
    elastic_id: Optional[str] = _var("KAITIAN_ELASTIC_ID", _text)
    elastic_join: bool = _var("KAITIAN_ELASTIC_JOIN", lambda env, name: _one_of("0", "1")(env, name) == "1", False,
                              write=lambda join: "1" if join else "0")
    elastic_run: str = _var("KAITIAN_ELASTIC_RUN", lambda env, name: env.get(name) or "0", "0")
    elastic_min_nodes: int = _var("KAITIAN_ELASTIC_MIN_NODES", _ranged(1, (1, 1 << 20)), 1)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Settings":
        """Reads the settings from ``env`` (default: ``os.environ``).

        Raises:
            SettingError: a variable is set to a value that cannot be used.
        """
        env = os.environ if env is None else env
        return cls(**{f.name: f.metadata["read"](env, f.metadata["env"]) for f in fields(cls)})

    def to_env(self) -> Dict[str, str]:
        """The variables that give a process these settings: one for each field not at its default."""
        return {
            f.metadata["env"]: f.metadata["write"](getattr(self, f.name))
            for f in fields(self) if getattr(self, f.name) != f.default
        }

    @classmethod
    def for_device(cls, device: WorkerDevice, **settings: Any) -> "Settings":
        """``settings`` plus the ones that give a worker ``device`` (``KAITIAN_GROUP``
        only for an explicit group: the backend defaults the group to the device type)."""
        return cls(device_type=device.type, device_index=device.index, device_uuid=device.uuid,
                   group=device.group if device.explicit_group else None, **settings)

    @property
    def device(self) -> Optional[WorkerDevice]:
        """The device a launcher gave this worker, or ``None`` without ``KAITIAN_DEVICE_TYPE``."""
        if not self.device_type:
            return None
        index = self.device_index if self.device_index is not None else 0
        return WorkerDevice(self.device_type, index, self.group or self.device_type, self.device_uuid)


def default_config_path(env: Mapping[str, str]) -> str:
    """``$XDG_CONFIG_HOME/kaitian/config.toml`` (``~/.config`` by default)."""
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "kaitian", "config.toml")


def settings() -> Settings:
    """The current process's settings (read fresh each call; cheap)."""
    return Settings.from_env()
