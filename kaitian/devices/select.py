"""Which devices a job uses: ``USE_<VENDOR>`` and ``--devices`` applied to the inventory.

Indices are physical (as ``kaitian devices`` lists them). A request that
matches nothing (``--devices cuda`` or ``USE_CUDA=0`` on a host without a GPU)
is an error, never a silent CPU run.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Mapping, Optional, Sequence

from kaitian.devices.device import Device
from kaitian.devices.vendors import VENDORS, vendor, vendor_names
from kaitian.errors import DeviceSelectionError

__all__ = ["parse_devices_flag", "select", "DeviceSelectionError"]


def parse_devices_flag(spec: str) -> Dict[str, str]:
    """``--devices`` -> ``{vendor: USE_<VENDOR> value}``.

    The flag lists device keys: ``cuda:0,cuda:1,cpu`` (``vendor`` alone means
    all of that vendor, ``vendor:-1`` none). Vendors it does not name keep
    their ``USE_<VENDOR>`` setting.

    Raises:
        DeviceSelectionError: malformed spec or unknown vendor.
    """
    chosen: Dict[str, List[str]] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        vendor_name, _, index = item.partition(":")
        if vendor_name not in VENDORS:
            raise DeviceSelectionError(
                f"--devices {spec!r}: unknown device type {vendor_name!r}; "
                f"use keys like cuda:0, mlu:1, cpu:0 (known types: {', '.join(VENDORS)})"
            )
        if index == "":
            chosen[vendor_name] = ["all"]
        elif not re.fullmatch(r"-?\d+", index):
            raise DeviceSelectionError(
                f"--devices {spec!r}: {item!r} is not <type>:<index>, e.g. cuda:0"
            )
        else:
            chosen.setdefault(vendor_name, []).append(index)
    result = {}
    for vendor_name, items in chosen.items():
        if "all" in items:
            result[vendor_name] = "all"
        elif items == ["-1"]:
            result[vendor_name] = "-1"
        else:
            result[vendor_name] = ",".join(i for i in items if i != "-1")
    return result


def _none_found(label: str, raw: str, kind: str, inventory: str, indices: Sequence[int] = ()) -> DeviceSelectionError:
    asked = "--devices " + kind if (label.startswith("--devices") and raw == "all") else f"{label}={raw}"
    if indices:
        asked += f": no such device {', '.join(str(i) for i in indices)}"
    return DeviceSelectionError(
        f"{asked}: no {kind} device found on this host (looked in {vendor(kind).sources}); "
        f"this host has: {inventory}"
    )


def _parse_use(label: str, raw: str, kind: str, have: List[Device], inventory: str) -> Optional[List[int]]:
    """One ``USE_<VENDOR>`` value -> physical indices (``None`` = all)."""
    raw = raw.strip()
    if raw.lower() in ("", "all"):
        if raw and not have and kind != "cpu":
            raise _none_found(label, raw, kind, inventory)
        return None
    if raw == "-1":
        return []
    indices: List[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not re.fullmatch(r"\d+", part):
            raise DeviceSelectionError(
                f"{label}={raw!r} is malformed: use all, -1 (none), or indices like 0,1; this host has: {inventory}"
            )
        indices.append(int(part))
    if not have and kind != "cpu":
        raise _none_found(label, raw, kind, inventory, indices)
    known = {d.index for d in have}
    missing = [i for i in indices if i not in known]
    if missing:
        raise DeviceSelectionError(
            f"{label}={raw}: no such device {', '.join(str(i) for i in missing)}; "
            f"this host has: {inventory}"
        )
    if len(set(indices)) != len(indices):
        raise DeviceSelectionError(f"{label}={raw}: an index is listed twice; this host has: {inventory}")
    return indices


def select(
    devices: Sequence[Device],
    env: Optional[Mapping[str, str]] = None,
    flag: Optional[Mapping[str, str]] = None,
) -> List[Device]:
    """The devices a job uses, from ``USE_<VENDOR>`` (and ``--devices``, which wins).

    Rules: unset = every device of that vendor; ``-1`` = none; ``0,2`` = those
    physical indices; ``all`` = every one, and at least one must exist. CPU
    slots are used when ``USE_CPU`` asks for them, or when no accelerator ends
    up selected.

    Raises:
        DeviceSelectionError: bad value, unknown index, a requested type with
            no device here, or nothing selected.
    """
    env = os.environ if env is None else env
    flag = flag or {}
    inventory = ", ".join(d.key for d in devices) or "no devices"
    chosen: List[Device] = []
    for kind in vendor_names():
        v = vendor(kind)
        have = [d for d in devices if d.type == kind]
        from_flag = kind in flag
        raw = flag[kind] if from_flag else env.get(v.selector_env, "")
        label = f"--devices {kind}" if from_flag else v.selector_env
        indices = _parse_use(label, raw, kind, have, inventory)
        if kind == "cpu" and not raw.strip() and chosen:
            continue  # CPU slots only when asked or when no accelerator is selected
        if indices is None:
            chosen.extend(have)
        else:
            by_index = {d.index: d for d in have}
            chosen.extend(by_index[i] for i in indices)
    if not chosen:
        raise DeviceSelectionError(
            f"no device selected (USE_*/--devices exclude everything); this host has: {inventory}"
        )
    return chosen
