"""``kaitian init``: measure each device's training throughput and write the config.

The config (TOML, ``$XDG_CONFIG_HOME/kaitian/config.toml`` or ``KAITIAN_CONFIG``)
holds the host's device inventory and, per device, its *capability*: samples
per second of a standard training workload (a fixed MLP, forward + backward +
SGD step, fp32). ``kaitianrun`` hands every rank its device's value as
``KAITIAN_CAPABILITY``; :class:`kaitian.DistributedSampler` splits batches by it.

::

    kaitian init                 # measure (once) and write the config
    kaitian init -r              # measure again (after a hardware change)
    kaitian init -r --cpu-slots 2 --seconds 3
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, Optional, Sequence

from kaitian.settings import settings
from kaitian.errors import CapabilityConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI (a declared dependency there)
    import tomli as tomllib

__all__ = [
    "load_capabilities",
    "load_config",
    "write_config",
    "measure_throughput",
    "CapabilityConfigError",
    "WORKLOAD",
]

# The standard workload: fixed so that numbers from different hosts compare.
WORKLOAD = {"name": "mlp-512-1024-1024-10", "batch": 128, "dtype": "float32"}
_CONFIG_VERSION = 1


def _config_path(path: Optional[str]) -> str:
    return path or settings().config_path


def load_config(path: Optional[str] = None) -> dict:
    """The whole config as a dict (empty if there is none).

    Raises:
        CapabilityConfigError: the file exists but is not valid UTF-8 TOML.
    """
    path = _config_path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError as exc:  # tomllib decodes before it parses
        raise CapabilityConfigError(
            f"cannot read the kaitian config {path}: it is not UTF-8 text (byte {exc.start}); "
            "run `kaitian init -r` to rewrite it"
        ) from None
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise CapabilityConfigError(
            f"cannot read the kaitian config {path}: {exc}; run `kaitian init -r` to rewrite it"
        ) from None


def load_capabilities(path: Optional[str] = None) -> Dict[str, float]:
    """Measured samples/s per device key (``"cuda:0"``, ``"cpu:1"``); ``{}`` without a config.

    Args:
        path: the config file (default: ``KAITIAN_CONFIG`` or the user config dir).

    Raises:
        CapabilityConfigError: the file exists but cannot be parsed.
    """
    devices = load_config(path).get("devices", {})
    if not isinstance(devices, dict):
        raise CapabilityConfigError(
            f"the kaitian config {_config_path(path)}: [devices] is not a table; run `kaitian init -r` to rewrite it"
        )
    caps: Dict[str, float] = {}
    for key, entry in devices.items():
        value = entry.get("capability") if isinstance(entry, dict) else None
        if isinstance(value, (int, float)) and value > 0:
            caps[str(key)] = float(value)
    return caps


def write_config(config: dict, path: Optional[str] = None) -> str:
    """Writes the config atomically (owner-only); returns the path."""
    import tomli_w

    path = _config_path(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(b"# written by `kaitian init`; run `kaitian init -r` to measure again\n")
            tomli_w.dump(config, f)
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise CapabilityConfigError(f"cannot write the kaitian config {path}: {exc}") from None
    return path


def measure_throughput(
    device: str,
    cpus: Sequence[int] = (),
    seconds: float = 2.0,
    progress: Optional[Callable[[float], None]] = None,
) -> float:
    """Samples/s of the standard workload on one device.

    Args:
        device: torch device string (``cpu``, ``cuda:0``, ``mlu:1``).
        cpus: cores to run on (CPU slots); the thread count follows.
        seconds: how long to measure (after a short warm-up).
        progress: called with the fraction done, now and then.

    Returns:
        Samples per second.
    """
    import torch

    kind = device.split(":")[0]
    from kaitian.devices.vendors import vendor

    v = vendor(kind)
    v.import_module()
    old_affinity = os.sched_getaffinity(0) if cpus else None
    old_threads = torch.get_num_threads()
    try:
        if cpus:
            os.sched_setaffinity(0, set(cpus))
            torch.set_num_threads(max(1, len(cpus)))
        dev = torch.device(device)
        if v.set_device is not None and dev.index is not None:
            v.set_device(dev.index)
        gen = torch.Generator().manual_seed(0)
        batch = WORKLOAD["batch"]
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        ).to(dev)
        x = torch.randn(batch, 512, generator=gen).to(dev)
        y = torch.randint(0, 10, (batch,), generator=gen).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sync = getattr(getattr(torch, kind, None), "synchronize", None) if kind != "cpu" else None

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(3):  # warm-up: allocator, kernels, caches
            step()
        if sync:
            sync()
        steps = 0
        start = time.perf_counter()
        elapsed = 0.0
        while elapsed < seconds:
            step()
            steps += 1
            if sync and steps % 10 == 0:
                sync()
            elapsed = time.perf_counter() - start
            if progress is not None and steps % 5 == 0:
                progress(min(1.0, elapsed / seconds))
        if sync:
            sync()
        elapsed = time.perf_counter() - start
        return steps * batch / elapsed
    finally:
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
        torch.set_num_threads(old_threads)


def _device_entry(device) -> dict:
    """A device as a TOML table (TOML has no null: unknown fields are left out)."""
    entry = {"vendor": device.type, "index": device.index, "name": device.name}
    for field_name in ("memory_bytes", "bus_id", "link"):
        value = getattr(device, field_name, None)
        if value is not None:
            entry[field_name] = value
    if device.cpus:
        entry["cpus"] = list(device.cpus)
    if device.capability is not None:
        entry["capability"] = round(float(device.capability), 3)
    return entry
