"""Device discovery, selection (``USE_<VENDOR>``, ``--devices``) and ``kaitian devices``.

Discovery is cheap on purpose: it runs in the launcher's start-up path. CUDA and
MLU details come from the vendor tools (``nvidia-smi``, ``cnmon``) that never
create a device context in the agent; without a tool, torch gives the count.
CPU "devices" are slots of this host's cores, one per NUMA node by default.
"""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass, field, replace
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from kaitian.devices import vendors as _vendors
from kaitian.errors import DeviceSelectionError

__all__ = [
    "format_cpulist",
    "Device",
    "DeviceSelectionError",
    "discover",
    "cpu_slots",
    "numa_nodes",
    "select",
    "parse_devices_flag",
    "format_table",
]


@dataclass
class Device:
    """One device of this host.

    Attributes:
        vendor: device type (``cuda``, ``mlu``, ``cpu``).
        index: the index torch uses for it (CPU: the slot index).
        name: product name (CPU: the cores it holds).
        memory_bytes: device memory, if known.
        bus_id: PCI bus id (CPU: ``numa<N>``), if known.
        link: host link (e.g. ``PCIe4 x16``), if known.
        cpus: cores a worker on this device is pinned to (CPU slots; host
            cores near the device for accelerators, where known).
        capability: measured samples/s from ``kaitian init``, if known.
    """

    vendor: str
    index: int
    name: str
    memory_bytes: Optional[int] = None
    bus_id: Optional[str] = None
    link: Optional[str] = None
    cpus: Tuple[int, ...] = field(default=())
    capability: Optional[float] = None

    @property
    def key(self) -> str:
        """``"<vendor>:<index>"``: the key used by ``kaitian init`` and ``--devices``."""
        return f"{self.vendor}:{self.index}"


# --- CPU ---------------------------------------------------------------------


def _parse_cpulist(text: str) -> List[int]:
    cpus: List[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return cpus


def numa_nodes(sys_root: str = "/sys/devices/system/node") -> Dict[int, List[int]]:
    """NUMA node -> the cores of this process's affinity mask on it.

    Falls back to a single node 0 with every allowed core when ``/sys`` has no
    NUMA information (containers, non-Linux).
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1)
    )
    nodes: Dict[int, List[int]] = {}
    try:
        for entry in sorted(os.listdir(sys_root)):
            m = re.fullmatch(r"node(\d+)", entry)
            if not m:
                continue
            with open(os.path.join(sys_root, entry, "cpulist")) as f:
                cores = [c for c in _parse_cpulist(f.read()) if c in allowed]
            if cores:
                nodes[int(m.group(1))] = cores
    except OSError:
        nodes = {}
    if not nodes or sum(len(c) for c in nodes.values()) < len(allowed):
        return {0: allowed}
    return nodes


def cpu_slots(count: Optional[int] = None) -> List[Device]:
    """This host's cores split into ``count`` slots (default: one per NUMA node).

    With an explicit count, cores are taken in NUMA order and split into
    contiguous, near-equal chunks, so a slot stays inside a node where it can.

    Raises:
        DeviceSelectionError: ``count`` is below 1 or above the number of cores.
    """
    nodes = numa_nodes()
    cores = [c for node in sorted(nodes) for c in nodes[node]]
    node_of = {c: node for node, cs in nodes.items() for c in cs}
    if count is None:
        chunks = [tuple(nodes[n]) for n in sorted(nodes)]
    else:
        if count < 1 or count > len(cores):
            raise DeviceSelectionError(
                f"--cpu-slots {count}: this host has {len(cores)} usable cores; "
                f"choose 1..{len(cores)}"
            )
        chunks = [
            tuple(cores[i * len(cores) // count:(i + 1) * len(cores) // count]) for i in range(count)
        ]
    model = _cpu_model()
    node_memory = _numa_memory(sorted(nodes))
    slots_on_node: Dict[int, int] = {}
    for chunk in chunks:
        for n in {node_of[c] for c in chunk}:
            slots_on_node[n] = slots_on_node.get(n, 0) + 1
    slots = []
    for i, chunk in enumerate(chunks):
        numas = sorted({node_of[c] for c in chunk})
        # a slot's share of its NUMA nodes' memory (an even split between slots)
        memory = sum(node_memory[n] // slots_on_node[n] for n in numas if node_memory.get(n))
        slots.append(
            Device(
                vendor="cpu",
                index=i,
                name=f"{model}, {len(chunk)} core{'' if len(chunk) == 1 else 's'}",
                memory_bytes=memory or None,
                bus_id=",".join(f"numa{n}" for n in numas),
                link=None,
                cpus=chunk,
            )
        )
    return slots


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def _numa_memory(nodes: Sequence[int], sys_root: str = "/sys/devices/system/node") -> Dict[int, int]:
    """NUMA node -> its memory in bytes (``/sys``; psutil's total for a host without NUMA info)."""
    found: Dict[int, int] = {}
    for n in nodes:
        try:
            with open(os.path.join(sys_root, f"node{n}", "meminfo")) as f:
                m = re.search(r"MemTotal:\s+(\d+)\s*kB", f.read())
            if m:
                found[n] = int(m.group(1)) * 1024
        except OSError:
            pass
    if not found and len(nodes) == 1:
        import psutil

        found[nodes[0]] = int(psutil.virtual_memory().total)
    return found


def format_cpulist(cpus: Iterable[int]) -> str:
    """``0-3,8`` from core numbers (the kernel's cpulist format)."""
    parts: List[str] = []
    start = prev = None
    for c in sorted(set(cpus)):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)


_cpu_slots = cpu_slots  # discover()'s parameter shadows the name


# --- accelerators ------------------------------------------------------------


def _cuda_from_smi() -> Optional[List[Device]]:
    if not _vendors.has_tool("nvidia-smi"):
        return None
    out = _vendors.run_tool(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,pci.bus_id,pcie.link.gen.max,pcie.link.width.max",
            "--format=csv,noheader,nounits",
        ]
    )
    if out is None:
        return None
    devices = []
    for row in csv.reader(io.StringIO(out)):
        if len(row) < 6:
            continue
        idx, name, mem, bus, gen, width = (x.strip() for x in row[:6])
        try:
            memory = int(float(mem)) * (1 << 20)
        except ValueError:
            memory = None
        link = f"PCIe{gen} x{width}" if gen.isdigit() and width.isdigit() else None
        devices.append(Device("cuda", int(idx), name, memory, bus.lower(), link))
    # CUDA_VISIBLE_DEVICES renumbers devices for torch; keep torch's numbering.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        by_id = {str(d.index): d for d in devices}
        by_id.update({d.bus_id or "": d for d in devices})
        devices = [
            replace(by_id[w], index=i) for i, w in enumerate(wanted) if w in by_id
        ]
    return devices


def _cuda_devices(detail: bool = True) -> List[Device]:
    found = _cuda_from_smi() if detail else None
    if found is not None:
        return found
    try:
        count = _vendors.vendor("cuda").count()
    except Exception:  # a broken driver must not stop a CPU job
        return []
    return [Device("cuda", i, "CUDA device") for i in range(count)]


def _mlu_from_cnmon() -> Optional[List[Device]]:
    if not _vendors.has_tool("cnmon"):
        return None
    out = _vendors.run_tool(["cnmon", "info", "-t", "-m", "-p"])
    if out is None:
        return None
    devices: List[Device] = []
    current: Optional[Device] = None
    for line in out.splitlines():
        m = re.match(r"\s*Card\s*(\d+)", line)
        if m:
            current = Device("mlu", int(m.group(1)), "MLU")
            devices.append(current)
            continue
        if current is None or ":" not in line:
            continue
        key, _, value = (s.strip() for s in line.partition(":"))
        if key.lower() in ("product name", "card name") and value:
            current.name = value
        elif key.lower() == "total" and current.memory_bytes is None:
            m = re.match(r"(\d+)\s*MiB", value)
            if m:
                current.memory_bytes = int(m.group(1)) * (1 << 20)
        elif key.lower() in ("bus id", "bdf", "pci bus id") and value:
            current.bus_id = value.lower()
    return devices


def _mlu_devices(detail: bool = True) -> List[Device]:
    found = _mlu_from_cnmon() if detail else None
    if found is not None:
        return found
    try:
        count = _vendors.vendor("mlu").count()
    except Exception:
        return []
    return [Device("mlu", i, "MLU device") for i in range(count)]


_DISCOVERERS = {"cuda": _cuda_devices, "mlu": _mlu_devices}


def discover(cpu_slots: Optional[int] = None, detail: bool = True) -> List[Device]:
    """Every device on this host, accelerators first, CPU slots last.

    Args:
        cpu_slots: number of CPU slots (default: one per NUMA node).
        detail: ask the vendor tools for names, memory, bus ids. ``False`` is
            the launcher's fast path: counts only, from torch.

    Returns:
        The devices in layout order (vendor table order, then index).

    Raises:
        DeviceSelectionError: ``cpu_slots`` is out of range.
    """
    found: List[Device] = []
    for name in _vendors.vendor_names():
        if name == "cpu":
            found.extend(_cpu_slots(cpu_slots))
        elif name in _DISCOVERERS:
            found.extend(_DISCOVERERS[name](detail))
    return found


# --- selection -----------------------------------------------------------------


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
        if vendor_name not in _vendors.VENDORS:
            raise DeviceSelectionError(
                f"--devices {spec!r}: unknown device type {vendor_name!r}; "
                f"use keys like cuda:0, mlu:1, cpu:0 (known types: {', '.join(_vendors.VENDORS)})"
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


def _parse_use(env_name: str, raw: str, have: List[Device], inventory: str) -> Optional[List[int]]:
    """One ``USE_<VENDOR>`` value -> indices (``None`` = all)."""
    raw = raw.strip()
    if raw.lower() in ("", "all"):
        return None
    if raw == "-1":
        return []
    indices: List[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not re.fullmatch(r"\d+", part):
            raise DeviceSelectionError(
                f"{env_name}={raw!r} is malformed: use -1, or indices like 0,1; this host has: {inventory}"
            )
        indices.append(int(part))
    known = {d.index for d in have}
    missing = [i for i in indices if i not in known]
    if missing:
        raise DeviceSelectionError(
            f"{env_name}={raw}: no such device {', '.join(str(i) for i in missing)}; "
            f"this host has: {inventory}"
        )
    if len(set(indices)) != len(indices):
        raise DeviceSelectionError(f"{env_name}={raw}: an index is listed twice; this host has: {inventory}")
    return indices


def select(
    devices: Sequence[Device],
    env: Optional[Mapping[str, str]] = None,
    flag: Optional[Mapping[str, str]] = None,
) -> List[Device]:
    """The devices a job uses, from ``USE_<VENDOR>`` (and ``--devices``, which wins).

    Rules: unset = every device of that vendor; ``-1`` = none; ``0,2`` = those
    indices. CPU slots are used when ``USE_CPU`` asks for them, or when no
    accelerator ends up selected.

    Raises:
        DeviceSelectionError: bad value, unknown index, or nothing selected.
    """
    env = os.environ if env is None else env
    flag = flag or {}
    inventory = ", ".join(d.key for d in devices) or "no devices"
    chosen: List[Device] = []
    cpu_asked = False
    for vendor_name in _vendors.vendor_names():
        v = _vendors.vendor(vendor_name)
        have = [d for d in devices if d.vendor == vendor_name]
        source = "--devices" if vendor_name in flag else v.selector_env
        raw = flag.get(vendor_name, env.get(v.selector_env, ""))
        label = f"{source} {vendor_name}" if source == "--devices" else source
        indices = _parse_use(label, raw, have, inventory)
        if vendor_name == "cpu":
            cpu_asked = raw.strip() not in ("",)
            if not cpu_asked and chosen:
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


# --- kaitian devices -----------------------------------------------------------


def _human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def attach_capabilities(devices: List[Device]) -> None:
    try:
        from kaitian.training.capability import load_capabilities
    except ImportError:
        return
    try:
        caps = load_capabilities()
    except Exception:  # a broken config must not stop the inventory
        return
    for d in devices:
        if d.key in caps:
            d.capability = float(caps[d.key])


def format_table(devices: Sequence[Device]) -> str:
    """The inventory as an aligned text table."""
    head = ("KEY", "VENDOR", "INDEX", "NAME", "MEMORY", "BUS ID", "LINK", "CPUS", "CAPABILITY")
    rows = [head]
    for d in devices:
        rows.append(
            (
                d.key,
                d.vendor,
                str(d.index),
                d.name,
                _human_bytes(d.memory_bytes),
                d.bus_id or "-",
                d.link or "-",
                format_cpulist(d.cpus) if d.cpus else "-",
                f"{d.capability:.1f}/s" if d.capability is not None else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
