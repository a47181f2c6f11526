"""Accelerator utilisation, for ``kaitianrun --monitor``: read from the vendors' tools."""

from __future__ import annotations

import re
from typing import Dict, Iterable

__all__ = ["device_utilisation"]


def device_utilisation(device_types: Iterable[str]) -> Dict[str, float]:
    """``{"cuda:0": percent, ...}`` for the devices of these types (empty where unknown)."""
    found: Dict[str, float] = {}
    for kind in set(device_types):
        probe = _PROBES.get(kind)
        if probe is not None:
            found.update(probe())
    return found


def _nvidia_utilisation() -> Dict[str, float]:
    """``{"cuda:<i>": percent}`` from nvidia-smi (empty when unavailable)."""
    from kaitian.devices.vendors import has_tool, run_tool

    if not has_tool("nvidia-smi"):
        return {}
    out = run_tool(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"], 5.0)
    result: Dict[str, float] = {}
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                result[f"cuda:{parts[0]}"] = float(parts[1])
            except ValueError:
                pass
    return result


def _cnmon_utilisation() -> Dict[str, float]:
    """``{"mlu:<i>": percent}`` from ``cnmon info -u`` (empty when unavailable)."""
    from kaitian.devices.vendors import has_tool, run_tool

    if not has_tool("cnmon"):
        return {}
    out = run_tool(["cnmon", "info", "-u"], 5.0) or ""
    result: Dict[str, float] = {}
    card = None
    for line in out.splitlines():
        m = re.match(r"\s*Card\s*(\d+)", line, re.IGNORECASE)
        if m:
            card = int(m.group(1))
            continue
        m = re.search(r"MLU Average\s*:\s*([\d.]+)\s*%", line)
        if m and card is not None:
            result[f"mlu:{card}"] = float(m.group(1))
    return result


_PROBES = {"cuda": _nvidia_utilisation, "mlu": _cnmon_utilisation}
