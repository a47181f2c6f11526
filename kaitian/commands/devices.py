"""``kaitian devices``: this host's device inventory."""

from __future__ import annotations

import sys
from typing import List, Optional

from kaitian.devices.device import Device
from kaitian.devices.inventory import discover, format_table, parse_devices_flag, select
from kaitian.errors import KaitianError

__all__ = ["main"]


def attach_capabilities(devices: List[Device]) -> None:
    """Fills in each device's measured capability from ``kaitian init``'s config, where known."""
    from kaitian.training.capability import load_capabilities

    try:
        caps = load_capabilities()
    except KaitianError as exc:  # a broken config must not stop the inventory
        print(f"kaitian devices: warning: {exc}", file=sys.stderr)
        return
    for d in devices:
        if d.key in caps:
            d.capability = float(caps[d.key])


def main(argv: Optional[List[str]] = None) -> int:
    """``kaitian devices [--cpu-slots N] [--selected]``: print this host's devices."""
    import argparse

    parser = argparse.ArgumentParser(prog="kaitian devices", description=main.__doc__)
    parser.add_argument("--cpu-slots", type=int, default=None, help="split the cores into N slots")
    parser.add_argument(
        "--selected", action="store_true", help="only the devices USE_* would select"
    )
    parser.add_argument("--devices", default=None, help="device keys, as for kaitianrun")
    args = parser.parse_args(argv)
    try:
        devices = discover(args.cpu_slots)
        if args.selected or args.devices:
            flag = parse_devices_flag(args.devices) if args.devices else None
            devices = select(devices, flag=flag)
    except KaitianError as e:
        print(f"kaitian devices: {e}", file=sys.stderr)
        return 2
    attach_capabilities(devices)
    print(format_table(devices))
    return 0
