"""``kaitian init [-r]``: measure each selected device's training throughput and write the config."""

from __future__ import annotations

import argparse
import datetime
import math
import socket
import sys
from typing import Callable, List, Optional

from kaitian.errors import KaitianError
from kaitian.training.capability import (
    _CONFIG_VERSION, WORKLOAD, _config_path, _device_entry, load_config,
    measure_throughput, write_config,
)

__all__ = ["main"]


def _progress_printer(label: str, stream) -> Callable[[float], None]:
    tty = stream.isatty()

    def show(fraction: float) -> None:
        if tty:
            bar = "#" * int(fraction * 20)
            stream.write(f"\r  {label:<12} [{bar:<20}] {fraction * 100:3.0f}%")
            stream.flush()

    return show


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kaitian init",
        description="Measure every selected device's training throughput and write the "
        "kaitian config (device inventory + capability).",
    )
    p.add_argument("-r", "--refresh", action="store_true",
                   help="measure again even if a config exists (after a hardware change)")
    p.add_argument("--cpu-slots", type=int, default=None,
                   help="split the cores into N CPU slots (use the value you give kaitianrun)")
    p.add_argument("--devices", default=None,
                   help="device keys to measure, as for kaitianrun (default: USE_* selection)")
    p.add_argument("--seconds", type=float, default=2.0, help="measuring time per device")
    p.add_argument("--config", default=None, help="config file (default: KAITIAN_CONFIG or "
                   "$XDG_CONFIG_HOME/kaitian/config.toml)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """``kaitian init [-r]``: measure devices and write the config; returns the exit code."""
    args = _parser().parse_args(argv)
    if not 0 < args.seconds < math.inf:
        print(f"kaitian init: --seconds must be a positive number, got {args.seconds:g}", file=sys.stderr)
        return 2
    from kaitian.devices.inventory import discover, format_table, parse_devices_flag, select
    from kaitian.devices.rank import torch_device_of

    path = _config_path(args.config)
    try:
        existing = load_config(path)
    except KaitianError as exc:
        if not args.refresh:
            print(f"kaitian init: {exc}", file=sys.stderr)
            return 2
        print(f"kaitian init: {exc.args[0].split('; run')[0]}; measuring again", file=sys.stderr)
        existing = {}
    if existing.get("devices") and not args.refresh:
        print(f"kaitian is already initialised ({path}):")
        _print_devices(existing)
        print("run `kaitian init -r` to measure again")
        return 0
    try:
        devices = discover(args.cpu_slots)
        flag = parse_devices_flag(args.devices) if args.devices else None
        devices = select(devices, flag=flag)
        if args.devices is None:
            # Measure the CPU slots too: a job may add them with USE_CPU.
            keys = {d.key for d in devices}
            devices += [d for d in discover(args.cpu_slots) if d.type == "cpu" and d.key not in keys]
    except KaitianError as exc:
        print(f"kaitian init: {exc}", file=sys.stderr)
        return 2
    print(f"kaitian init: measuring {len(devices)} device(s), {args.seconds:g} s each "
          f"(workload {WORKLOAD['name']}, batch {WORKLOAD['batch']})")
    for i, d in enumerate(devices, 1):
        label = d.key
        show = _progress_printer(label, sys.stdout)
        show(0.0)
        try:
            torch_device = torch_device_of(d.worker_device())  # physical index -> this process's ordinal
            d.capability = measure_throughput(torch_device, d.cpus if d.type == "cpu" else (),
                                              args.seconds, show)
        except Exception as exc:  # one broken device must not stop the others
            print(f"\r  [{i}/{len(devices)}] {label:<12} failed: {exc}")
            d.capability = None
            continue
        print(f"\r  [{i}/{len(devices)}] {label:<12} {d.capability:12.1f} samples/s" + " " * 20)
    config = {
        "version": _CONFIG_VERSION,
        "host": socket.gethostname(),
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "workload": dict(WORKLOAD, seconds=args.seconds),
        "devices": dict(existing.get("devices", {})),
    }
    for d in devices:
        config["devices"][d.key] = _device_entry(d)
    try:
        written = write_config(config, path)
    except KaitianError as exc:
        print(f"kaitian init: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    print(format_table(devices))
    return 0


def _print_devices(config: dict) -> None:
    for key, entry in sorted(config.get("devices", {}).items()):
        cap = entry.get("capability")
        cap_text = f"{cap:.1f} samples/s" if isinstance(cap, (int, float)) else "not measured"
        print(f"  {key:<12} {entry.get('name', ''):<30} {cap_text}")

